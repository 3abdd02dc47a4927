"""The object-store mirror (mirrord.store.s3) against a real S3 server: commit points, aborts, the stale
upload sweep, the conditional manifest, the lease, guarded deletes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mirrord.core.model import ManifestEntry
from mirrord.errors import LockedError, TransientError
from mirrord.store.manifest import Change, encode_snapshot
from mirrord.store.s3 import S3Mirror, S3Settings
from mirrord.store.s3 import mirror as s3_mirror
from mirrord.store.s3.lease import Lease
from mirrord.store.s3.manifest import MANIFEST_DIR
from mirrord.store.volume import ChangedError
from tests.s3.seaweed import SeaweedServer
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

MIB = 1 << 20
PART = 5 * MIB  # S3's smallest part


def _mirror(seaweed: SeaweedServer, bucket: str, prefix: str, **settings: Any) -> S3Mirror:
    return S3Mirror(
        f"s3://{bucket}/{prefix}", S3Settings(endpoint_url=seaweed.endpoint, part_size=PART, concurrency=2, **settings)
    )


def _uploads(s3_client: Any, bucket: str, prefix: str) -> list[str]:
    answer = s3_client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/")
    return [u["Key"][len(prefix) + 1 :] for u in answer.get("Uploads", [])]


def _write(upload: Any, data: bytes, chunk: int = MIB) -> None:
    view = memoryview(data)
    for i in range(0, len(data), chunk):
        upload.write(view[i : i + chunk])


def test_multipart_file_is_visible_only_at_complete(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str, checkpoint: Any, tmp_path: Path
) -> None:
    mirror = _mirror(seaweed, bucket, prefix)
    source = checkpoint(tmp_path / "step_10.pt", 10, width=700)  # ~12 MB: three parts
    data = source.read_bytes()
    assert len(data) > 2 * PART
    upload = mirror.begin_upload("a/step_10.pt", len(data))
    _write(upload, data)
    assert upload.seal(0) is None
    assert mirror.stat("a/step_10.pt") is None  # every part is on the server, the object is not
    assert _uploads(s3_client, bucket, prefix) == ["a/step_10.pt"]
    upload.commit()
    state = mirror.stat("a/step_10.pt")
    assert state is not None and state.size == len(data)
    assert upload.stored_mtime_ns == state.mtime_ns
    assert _uploads(s3_client, bucket, prefix) == []
    with mirror.open_read("a/step_10.pt") as fh:
        assert fh.read() == data
    assert set(mirror.snapshot(["*.pt"]).files) == {"a/step_10.pt"}


def test_small_file_is_one_put_and_abort_leaves_nothing(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str
) -> None:
    mirror = _mirror(seaweed, bucket, prefix)
    small = mirror.begin_upload("step_1.pt", 3)
    small.write(memoryview(b"abc"))
    small.seal(0)
    assert mirror.stat("step_1.pt") is None
    small.commit()
    assert mirror.stat("step_1.pt") is not None

    big = mirror.begin_upload("step_2.pt", 3 * PART)
    _write(big, os.urandom(2 * PART))  # two parts sent, the third never comes
    assert _uploads(s3_client, bucket, prefix) == ["step_2.pt"]
    big.abort()
    assert _uploads(s3_client, bucket, prefix) == []
    assert mirror.stat("step_2.pt") is None
    assert set(mirror.snapshot(["*.pt"]).files) == {"step_1.pt"}


def test_bytes_that_arrive_other_than_sent_are_refused_and_nothing_becomes_visible(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each part (and a small file's PUT) carries the CRC-32 mirrord computed from its bytes; the server
    checks it. Bytes that arrive other than they were read (here: the second part's checksum describes
    other bytes) are refused, the upload is aborted, and no object appears."""
    real = s3_mirror._checksum
    calls: list[int] = []

    def garbled_second(body: bytes | bytearray) -> str:
        calls.append(len(body))
        return real(bytes(body) + b"!") if len(calls) == 2 else real(body)

    monkeypatch.setattr(s3_mirror, "_checksum", garbled_second)
    mirror = _mirror(seaweed, bucket, prefix, max_attempts=1)
    data = os.urandom(3 * PART)
    big = mirror.begin_upload("step_3.pt", len(data))
    with pytest.raises(TransientError, match="BadDigest"):
        _write(big, data)
        big.seal(0)
    big.abort()
    assert _uploads(s3_client, bucket, prefix) == []
    assert mirror.stat("step_3.pt") is None

    calls.clear()
    calls.append(0)  # the next call is the second: the small file's one PUT
    small = mirror.begin_upload("step_1.pt", 3)
    small.write(memoryview(b"abc"))
    small.seal(0)
    with pytest.raises(TransientError, match="BadDigest"):
        small.commit()
    assert mirror.stat("step_1.pt") is None
    assert mirror.snapshot(["*.pt"]).files == {}


def test_a_checksum_answered_back_other_than_sent_fails_the_upload(
    seaweed: SeaweedServer, bucket: str, prefix: str
) -> None:
    """A server that answers a part's or an object's checksum echoes the one it computed over what it
    stored: an answer other than ours means it stored other bytes, and the copy is not counted."""
    mirror = _mirror(seaweed, bucket, prefix, max_attempts=1)

    def other_answer(parsed: dict[str, Any], **_: Any) -> None:
        parsed["ChecksumCRC32"] = "AAAAAA=="

    mirror.client.meta.events.register("after-call.s3.UploadPart", other_answer)
    big = mirror.begin_upload("step_2.pt", 2 * PART)
    with pytest.raises(TransientError, match="CRC-32 AAAAAA=="):
        _write(big, os.urandom(2 * PART))
        big.seal(0)
    big.abort()
    assert mirror.stat("step_2.pt") is None

    mirror.client.meta.events.register("after-call.s3.PutObject", other_answer)
    small = mirror.begin_upload("step_1.pt", 3)
    small.write(memoryview(b"abc"))
    small.seal(0)
    with pytest.raises(TransientError, match="CRC-32 AAAAAA=="):
        small.commit()


def test_kill9_mid_upload_leaves_no_object_and_the_sweep_aborts_it(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str, s3_env: dict[str, str]
) -> None:
    child = textwrap.dedent(f"""
        import os, sys, time
        from mirrord.store.s3 import S3Mirror, S3Settings
        mirror = S3Mirror("s3://{bucket}/{prefix}", S3Settings(endpoint_url={seaweed.endpoint!r}, part_size={PART}))
        upload = mirror.begin_upload("step_5.pt", {4 * PART})
        upload.write(memoryview(os.urandom({2 * PART})))
        upload._parts[0].result()
        print("part sent", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"part sent\n"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()  # type: ignore[union-attr]
    mirror = _mirror(seaweed, bucket, prefix)
    assert mirror.stat("step_5.pt") is None
    assert _uploads(s3_client, bucket, prefix) == ["step_5.pt"]
    assert mirror.sweep_stale_uploads(older_than=3600) == 0  # younger than the age guard: may be live
    wait_for(lambda: mirror.stale_uploads(older_than=1), 60, "the upload to be older than 1 s by the server's clock")
    assert mirror.sweep_stale_uploads(older_than=1) == 1
    assert _uploads(s3_client, bucket, prefix) == []
    assert s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("KeyCount", 0) == 0


def _entry(path: str) -> ManifestEntry:
    return ManifestEntry(path, 1, "blake3", "0" * 64, 1, 1, 1.0)


def test_manifest_writers_never_overwrite_each_other(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str
) -> None:
    one, two = _mirror(seaweed, bucket, prefix), _mirror(seaweed, bucket, prefix)
    first, second = one.read_manifest(), two.read_manifest()  # both read "no manifest yet"
    first.record(_entry("run/a_step_1.pt"))
    second.record(_entry("run/b_step_1.pt"))  # If-None-Match: * fails, re-read, re-applied on top
    second.record(_entry("run/b_step_2.pt"))
    first.remove("run/a_step_1.pt")  # If-Match on a stale ETag fails, re-read, re-applied
    assert set(one.load_manifest().entries) == {"run/b_step_1.pt", "run/b_step_2.pt"}
    body = s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_DIR}/folders/run.json")["Body"].read()
    assert b"run/b_step_2.pt" in body and b"run/a_step_1.pt" not in body


def test_manifest_store_gives_up_with_a_clear_error_when_always_beaten(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str
) -> None:
    from mirrord.errors import ManifestError

    mirror = _mirror(seaweed, bucket, prefix)
    store = mirror.manifest_store()
    store.load()
    key = f"{prefix}/{MANIFEST_DIR}/folders/x.json"
    racer = iter(range(100))

    def someone_writes_first(params: dict[str, Any], **_: Any) -> None:
        if params.get("Key") == key:  # a racing writer, always between our read and our write
            theirs = _entry(f"x/other_{next(racer)}.pt")
            s3_client.put_object(Bucket=bucket, Key=key, Body=encode_snapshot({theirs.path: theirs}))

    mirror.client.meta.events.register("before-parameter-build.s3.PutObject", someone_writes_first)
    with pytest.raises(ManifestError, match="another writer changed the manifest"):
        store.append([Change((_entry("x/step_1.pt"),)).encode()])


def test_lease_refuses_a_second_holder_and_expires(seaweed: SeaweedServer, bucket: str, prefix: str) -> None:
    mirror = _mirror(seaweed, bucket, prefix, node="node-a")
    with mirror.lock():
        same_node = _mirror(seaweed, bucket, prefix, node="node-a")
        with pytest.raises(LockedError, match="holds this mirror's lease"), same_node.lock():
            pass
        with _mirror(seaweed, bucket, prefix, node="node-b").lock():  # another node: its own lease
            assert mirror.lock_problem() is None
    with _mirror(seaweed, bucket, prefix, node="node-a").lock():  # released: free again
        pass

    now = [1000.0]
    client = mirror.client
    old = Lease(client, bucket, f"{prefix}/.mirrord-leases/n", 30, wall=lambda: now[0])
    old.acquire()
    now[0] += 31  # expired: the holder died without releasing
    new = Lease(client, bucket, f"{prefix}/.mirrord-leases/n", 30, wall=lambda: now[0])
    new.acquire()
    old.renew()
    lost = old.lost()
    assert lost is not None and "took the lease" in lost and old.problem() == lost
    with pytest.raises(LockedError):
        old.require()
    new.renew()
    assert new.lost() is None and new.problem() is None


def test_delete_rechecks_the_object(seaweed: SeaweedServer, bucket: str, prefix: str) -> None:
    mirror = _mirror(seaweed, bucket, prefix)
    for payload in (b"one", b"one-replaced"):
        upload = mirror.begin_upload("step_3.pt", len(payload))
        upload.write(memoryview(payload))
        upload.seal(0)
        upload.commit()
        if payload == b"one":
            planned = mirror.stat("step_3.pt")
    assert planned is not None
    with pytest.raises(ChangedError):
        mirror.delete("step_3.pt", planned)  # a newer upload under the same key is never deleted
    current = mirror.stat("step_3.pt")
    assert current is not None
    mirror.delete("step_3.pt", current)
    assert mirror.stat("step_3.pt") is None


def test_object_hash_matches_the_source(seaweed: SeaweedServer, bucket: str, prefix: str, tmp_path: Path) -> None:
    from mirrord.store.hashing import new_hasher

    mirror = _mirror(seaweed, bucket, prefix)
    source = tmp_path / "step_4.pt"
    source.write_bytes(os.urandom(PART + 123))
    upload = mirror.begin_upload("step_4.pt", source.stat().st_size)
    _write(upload, source.read_bytes(), chunk=777_777)  # chunks that do not line up with parts
    upload.seal(0)
    upload.commit()
    hasher = new_hasher("blake3")
    with mirror.open_read("step_4.pt") as fh:
        while chunk := fh.read(MIB):
            hasher.update(chunk)
    assert hasher.hexdigest() == hash_file(source, "blake3")


def test_an_object_is_read_in_order_through_parallel_ranged_gets(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str
) -> None:
    """open_read gives every byte in order, for an empty object, one of a part and one of 3.5 parts (its first
    range streamed, the rest as ranged GETs, two in flight at most); the object replaced while it is read:
    ChangedError, never bytes of two objects."""
    mirror = _mirror(seaweed, bucket, prefix)
    ranges: list[str] = []
    mirror.client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: ranges.append(params.get("headers", {}).get("Range", ""))
    )
    for size in (0, PART, 3 * PART + PART // 2):
        data = os.urandom(size)
        s3_client.put_object(Bucket=bucket, Key=f"{prefix}/obj", Body=data)
        with mirror.open_read("obj") as stream:
            assert stream.read() == data, size
    assert ranges[-4:] == [f"bytes={s}-{min(s + PART, 3 * PART + PART // 2) - 1}" for s in range(0, 4 * PART, PART)]
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/obj", Body=os.urandom(3 * PART))
    with mirror.open_read("obj") as stream:
        stream.read(PART)
        s3_client.put_object(Bucket=bucket, Key=f"{prefix}/obj", Body=os.urandom(3 * PART))
        with pytest.raises(ChangedError, match="replaced while it was read"):
            stream.read()
