"""The manifest: documented JSON schema, atomic persistence, loud failure on corruption, rollback."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import mirrord.store.manifest as manifest_module
from mirrord.core.model import ManifestEntry
from mirrord.errors import ManifestError, NoSpaceError
from mirrord.store.manifest import MANIFEST_NAME, SCHEMA, SCHEMA_VERSION, Manifest, decode_snapshot, encode_snapshot
from mirrord.store.volume import LocalMirror
from tests.support.mirror import names


def entry(path: str = "run/step_0010.pt", size: int = 2_470_000_000, step: int | None = 10) -> ManifestEntry:
    return ManifestEntry(
        path=path,
        size=size,
        algo="blake3",
        digest="ab" * 32,
        source_mtime_ns=1_700_000_000_123_456_789,
        step=step,
        mirrored_at=1_700_000_100.5,
    )


def doc(entries: Any) -> bytes:
    return json.dumps({"schema": SCHEMA, "version": SCHEMA_VERSION, "entries": entries}).encode()


GOOD = {"size": 1, "hash": {"algo": "blake3", "digest": "ab" * 32}, "source_mtime_ns": 5, "step": 1, "mirrored_at": 1.0}


def test_json_layout_is_the_documented_schema() -> None:
    """The on-disk format other tools read (see the README): schema, version, entries keyed by path."""
    data = json.loads(encode_snapshot({"run/step_0010.pt": entry()}))
    assert data == {
        "schema": "mirrord-manifest",
        "version": 1,
        "entries": {
            "run/step_0010.pt": {
                "size": 2_470_000_000,
                "hash": {"algo": "blake3", "digest": "ab" * 32},
                "source_mtime_ns": 1_700_000_000_123_456_789,
                "step": 10,
                "mirrored_at": 1_700_000_100.5,
                # issue 14: the validator's verdict (null: recorded before validation existed) and the
                # published copy's inode and ctime (0: unknown), so `latest` need not re-hash it
                "validation": None,
                "mirror_ino": 0,
                "mirror_ctime_ns": 0,
                # issue 41: what the file is, its source's identity when copied, the recording sequence
                "layout": "",
                "members": 1,
                "source_dev": 0,
                "source_ino": 0,
                "source_ctime_ns": 0,
                "seq": 0,
                "seen": 0,
            }
        },
    }
    assert MANIFEST_NAME == ".mirrord-manifest.json"


def test_a_manifest_without_the_validation_fields_still_loads() -> None:
    """Entries written before issue 14 lack validation and the copy's stat: they load with defaults."""
    [loaded] = decode_snapshot(doc({"run/step_0001.pt": GOOD}), "manifest")[0].values()
    assert (loaded.validation, loaded.mirror_ino, loaded.mirror_ctime_ns) == (None, 0, 0)


def test_round_trip_keeps_every_field_exactly() -> None:
    """Nanosecond mtimes and sizes beyond 2**53 survive (JSON integers, not floats)."""
    made = (entry(), entry("step_0001.pt", size=2**60, step=None), entry("a/b/c/x.pt", step=0))
    entries = {e.path: e for e in made}
    assert decode_snapshot(encode_snapshot(entries), "manifest")[0] == entries


def test_serialisation_is_deterministic() -> None:
    a, b = entry("b.pt"), entry("a.pt")
    assert encode_snapshot({"b.pt": a, "a.pt": b}) == encode_snapshot({"a.pt": b, "b.pt": a})


def test_absent_manifest_is_empty(tmp_path: Path) -> None:
    assert len(Manifest.load(tmp_path)) == 0


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b'{"schema": "mirrord-manifest", "version": 1, "entries": {', id="truncated"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(b"[]", id="not-an-object"),
        pytest.param(b'{"schema": "other", "version": 1, "entries": {}}', id="wrong-schema"),
        pytest.param(b'{"schema": "mirrord-manifest", "version": 2, "entries": {}}', id="future-version"),
        pytest.param(b'{"schema": "mirrord-manifest", "version": 1}', id="no-entries"),
        pytest.param(doc({"a.pt": {k: v for k, v in GOOD.items() if k != "size"}}), id="entry-without-size"),
        pytest.param(doc({"a.pt": {**GOOD, "size": "big"}}), id="size-not-a-number"),
        pytest.param(doc({"a.pt": {**GOOD, "hash": "abc"}}), id="hash-not-an-object"),
        pytest.param(doc([]), id="entries-not-an-object"),
        pytest.param(doc({"a.pt": []}), id="entry-not-an-object"),
        pytest.param(doc({"../../etc/passwd": GOOD}), id="path-escapes-the-root"),
        pytest.param(doc({"/etc/passwd": GOOD}), id="absolute-path"),
        pytest.param(doc({"a.pt": {**GOOD, "hash": {"algo": "md5", "digest": "0"}}}), id="unknown-algorithm"),
    ],
)
def test_corrupt_manifest_raises_manifest_error_naming_the_file(tmp_path: Path, data: bytes) -> None:
    """Nothing may be trusted from a manifest that does not parse completely: one typed error, no crash."""
    (tmp_path / MANIFEST_NAME).write_bytes(data)
    with pytest.raises(ManifestError) as info:
        Manifest.load(tmp_path)
    assert info.value.path == str(tmp_path / MANIFEST_NAME)
    assert not info.value.transient


def test_unreadable_manifest_raises_manifest_error(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).mkdir()  # EISDIR on read: a real I/O error, even for root
    with pytest.raises(ManifestError, match="cannot read"):
        Manifest.load(tmp_path)


def journals(root: Path) -> list[str]:
    return sorted(n for n in names(root) if ".journal." in n)


def test_changes_are_journaled_and_read_back(tmp_path: Path) -> None:
    """Each change is one journal record; a reader replays them on the snapshot; no temp file is left.
    Opening writes nothing (a read-only mirror can still be opened); the first change publishes an empty
    snapshot before the first journal."""
    manifest = Manifest.open(tmp_path)
    assert names(tmp_path) == []
    manifest.record(entry("a.pt"))
    manifest.record(entry("b.pt"))
    manifest.remove("a.pt")
    assert names(tmp_path) == [".mirrord-manifest.journal.0", MANIFEST_NAME]
    assert json.loads((tmp_path / MANIFEST_NAME).read_bytes())["entries"] == {}  # the snapshot is untouched
    assert Manifest.load(tmp_path).entries == {"b.pt": entry("b.pt")} == manifest.entries


def test_removing_an_absent_entry_writes_nothing(tmp_path: Path) -> None:
    manifest = Manifest.open(tmp_path)
    manifest.record(entry("a.pt"))
    journal = tmp_path / journals(tmp_path)[0]
    size = journal.stat().st_size
    manifest.remove("never-there.pt")
    manifest.apply(removes=["never-there.pt", "nor-this.pt"])
    assert journal.stat().st_size == size


def test_a_batch_is_one_record(tmp_path: Path) -> None:
    manifest = Manifest.open(tmp_path)
    manifest.apply(puts=[entry(f"s{i}.pt") for i in range(50)])
    journal = tmp_path / journals(tmp_path)[0]
    lines = journal.read_bytes().splitlines()
    manifest.apply(removes=[f"s{i}.pt" for i in range(40)])
    assert len(journal.read_bytes().splitlines()) == len(lines) + 1  # header + 1, then + 1 again
    assert sorted(Manifest.load(tmp_path).entries) == sorted(f"s{i}.pt" for i in range(40, 50))
    with pytest.raises(ValueError):
        manifest.apply(puts=[entry("x.pt")], removes=["x.pt"])


def test_local_mirror_journals_and_reloads(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path)
    manifest = mirror.read_manifest()
    manifest.record(entry())
    assert not [n for n in names(tmp_path) if n.endswith(".part")]
    assert Manifest.load(tmp_path).entries == {"run/step_0010.pt": entry()}
    manifest.remove("run/step_0010.pt")
    assert len(Manifest.load(tmp_path)) == 0


class FailingFsync:
    """os.fsync that fails (EIO) the next time it is called on the journal: a real fault on the real path."""

    def __init__(self, real: Any) -> None:
        self.real, self.armed, self.calls = real, False, 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.armed and ".journal." in str(Path(f"/proc/self/fd/{fd}").readlink()):
            self.armed = False
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.real(fd)


def test_a_failed_append_changes_nothing_and_never_comes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory never claims what the disk may not hold, and the disk never replays it: each failed record
    reached the journal before its fsync failed, and a compaction at once makes that journal stale (never
    fsynced again), so a fresh load, as after a restart, shows only the changes acknowledged as durable."""
    manifest = Manifest.open(tmp_path)
    manifest.record(entry("a.pt", size=1))
    fsync = FailingFsync(os.fsync)
    monkeypatch.setattr(os, "fsync", fsync)
    fsync.armed = True
    with pytest.raises(ManifestError) as info:
        manifest.record(entry("a.pt", size=2))
    assert ".journal.0" in str(info.value.path) and "Input/output error" in info.value.cause
    assert manifest.get("a.pt") == entry("a.pt", size=1)
    assert Manifest.load(tmp_path).entries == manifest.entries
    with pytest.raises(ManifestError):
        fsync.armed = True
        manifest.remove("a.pt")
    assert manifest.entries == {"a.pt": entry("a.pt", size=1)} == Manifest.load(tmp_path).entries
    manifest.record(entry("b.pt"))
    assert Manifest.load(tmp_path).entries == manifest.entries == {"a.pt": entry("a.pt", size=1), "b.pt": entry("b.pt")}


def test_no_space_for_the_journal_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = Manifest.open(tmp_path)
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        if ".journal." in str(Path(f"/proc/self/fd/{fd}").readlink()):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(NoSpaceError) as info:
        manifest.record(entry("a.pt"))
    assert info.value.transient and len(manifest) == 0


def test_concurrent_changes_all_reach_the_disk(tmp_path: Path) -> None:
    manifest = Manifest.open(tmp_path)

    def worker(n: int) -> None:
        for i in range(25):
            manifest.record(entry(f"w{n}/step_{i}.pt", step=i))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(manifest) == 200
    assert Manifest.load(tmp_path).entries == manifest.entries


def test_changes_waiting_for_a_write_share_the_next_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: while one record is being fsynced, the changes that arrive are written together,
    with one fsync, and each caller returns only once its own change is durable."""
    manifest = Manifest.open(tmp_path)
    manifest.record(entry("first.pt"))  # the journal exists: only appends are counted below
    real = os.fsync
    entered, release = threading.Event(), threading.Event()
    synced: list[int] = []

    def fsync(fd: int) -> None:
        synced.append(fd)
        if len(synced) == 1:
            entered.set()
            assert release.wait(30)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    returned: list[str] = []

    def record(name: str) -> None:
        manifest.record(entry(name))
        returned.append(name)

    first = threading.Thread(target=record, args=("a.pt",))
    first.start()
    assert entered.wait(30)
    others = [threading.Thread(target=record, args=(f"{c}.pt",)) for c in "bcd"]
    for t in others:
        t.start()
    wait = 0
    while len(manifest._queue) < 3 and wait < 3000:  # all three are queued behind the fsync
        threading.Event().wait(0.01)
        wait += 1
    assert returned == [] and len(manifest) == 1
    release.set()
    for t in [first, *others]:
        t.join(30)
    assert sorted(returned) == ["a.pt", "b.pt", "c.pt", "d.pt"]
    assert len(synced) == 2
    assert sorted(Manifest.load(tmp_path).entries) == ["a.pt", "b.pt", "c.pt", "d.pt", "first.pt"]


def test_compaction_folds_the_journal_into_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_module, "COMPACT_MIN_RECORDS", 5)
    manifest = Manifest.open(tmp_path, background_compaction=False)
    for i in range(23):
        manifest.record(entry(f"s{i:02d}.pt", step=i))
        if i % 3 == 0:
            manifest.remove(f"s{i:02d}.pt")
    snapshot = json.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert snapshot["journal"] >= 3  # compacted a few times
    assert journals(tmp_path) == [f".mirrord-manifest.journal.{snapshot['journal']}"]  # older ones dropped
    assert Manifest.load(tmp_path).entries == manifest.entries
    manifest.close()
    snapshot = json.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert decode_snapshot((tmp_path / MANIFEST_NAME).read_bytes(), "manifest")[0] == manifest.entries
    journal = (tmp_path / journals(tmp_path)[0]).read_bytes()
    assert len(journal.splitlines()) == 1  # the header of an empty journal
    assert Manifest.open(tmp_path).entries == manifest.entries


def test_changes_go_on_while_a_compaction_writes_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The change that makes a compaction due does not wait for it, nor do the changes after it; close()
    waits for it and folds in what came meanwhile."""
    monkeypatch.setattr(manifest_module, "COMPACT_MIN_RECORDS", 3)
    manifest = Manifest.open(tmp_path)
    manifest.record(entry("a0.pt"))  # the first change also publishes the (empty) snapshot
    store = manifest._store
    real_publish = store.publish_snapshot
    writing, release = threading.Event(), threading.Event()

    def slow_publish(data: bytes) -> None:
        writing.set()
        assert release.wait(30)
        real_publish(data)

    monkeypatch.setattr(store, "publish_snapshot", slow_publish)
    for i in range(1, 3):
        manifest.record(entry(f"a{i}.pt"))
    assert writing.wait(30)  # the compaction is writing its snapshot, in another thread
    for i in range(5):
        manifest.record(entry(f"b{i}.pt"))  # appended to the new journal meanwhile
    assert len(Manifest.load(tmp_path)) == 8
    release.set()
    manifest.close()
    snapshot = (tmp_path / MANIFEST_NAME).read_bytes()
    assert len(decode_snapshot(snapshot, "manifest")[0]) == 8
    assert journals(tmp_path) == [f".mirrord-manifest.journal.{json.loads(snapshot)['journal']}"]


def test_a_manifest_from_before_the_journal_is_read_and_extended(tmp_path: Path) -> None:
    """Backward compatible: a version-1 manifest without a journal generation is generation 0."""
    (tmp_path / MANIFEST_NAME).write_bytes(doc({"a.pt": GOOD}))
    manifest = Manifest.open(tmp_path)
    manifest.record(entry("b.pt"))
    assert sorted(Manifest.load(tmp_path).entries) == ["a.pt", "b.pt"]
    manifest.close()
    data = json.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert data["version"] == 1 and sorted(data["entries"]) == ["a.pt", "b.pt"]


def test_a_manifest_with_an_earlier_releases_binary_companion_loads_from_its_json(tmp_path: Path) -> None:
    """Earlier releases could write `.mirrord-manifest.packed` beside the snapshot, a copy of it: it is not
    read (whatever it holds), and the snapshot and journal it sat beside load and take changes as ever."""
    (tmp_path / MANIFEST_NAME).write_bytes(doc({"a.pt": GOOD}))
    (tmp_path / ".mirrord-manifest.packed").write_bytes(b"MIRRORDPACKED\x00" + os.urandom(64))
    manifest = Manifest.open(tmp_path)
    manifest.record(entry("b.pt"))
    assert sorted(Manifest.load(tmp_path).entries) == ["a.pt", "b.pt"]
    manifest.close()
    assert sorted(Manifest.load(tmp_path).entries) == ["a.pt", "b.pt"]


def test_unknown_entry_fields_are_ignored_and_every_dataclass_field_is_stored() -> None:
    """Entries are encoded field by field, so a newer writer's extra fields do not break this reader."""
    data = decode_snapshot(doc({"a.pt": {**GOOD, "ino_from_the_future": 7}}), "manifest")[0]
    assert data["a.pt"].size == 1
    # (mirror_mtime_ns is written only where the mirror stored another mtime than the source's)
    clamped = dataclasses.replace(entry("a.pt"), mirror_mtime_ns=2_147_483_647 * 10**9)
    stored = json.loads(encode_snapshot({"a.pt": clamped}))["entries"]["a.pt"]
    # (node is written only on a mirror several nodes share, unit for a folder's member, role beside checkpoints)
    unwritten = {"path", "algo", "digest", "node", "unit", "role"}
    assert set(stored) == {f.name for f in dataclasses.fields(ManifestEntry)} - unwritten | {"hash"}


def test_entries_is_a_snapshot() -> None:
    manifest = Manifest()
    view = manifest.entries
    manifest.record(entry("a.pt"))
    assert view == {} and list(manifest.entries) == ["a.pt"]


def test_every_field_survives_a_save_and_a_load(tmp_path: Path) -> None:
    """Each field is read back by name: a field added to ManifestEntry but not to decoding would come back
    as its default (an upper-case digest and an unknown validation word too)."""
    values = {
        "size": 11,
        "algo": "sha256",
        "digest": "0a" * 32,
        "source_mtime_ns": 12,
        "step": 13,
        "mirrored_at": 14.5,
        "mirror_mtime_ns": 15,
        "validation": "ok",
        "mirror_ino": 16,
        "mirror_ctime_ns": 17,
        "node": "node-a",
        "layout": "hf",
        "unit": "r",
        "members": 2,
        "role": "alias",
        "source_dev": 18,
        "source_ino": 19,
        "source_ctime_ns": 20,
        "seq": 21,
        "seen": 22,
    }
    assert set(values) | {"path"} == {f.name for f in dataclasses.fields(ManifestEntry)}
    full = ManifestEntry("r/a.pt", **values)  # type: ignore[arg-type]
    odd = dataclasses.replace(full, path="r/b.pt", digest="0A" * 32, validation="from-the-future")
    (tmp_path / MANIFEST_NAME).write_bytes(encode_snapshot({"r/a.pt": full, "r/b.pt": odd}))
    loaded = Manifest.load(tmp_path)
    assert loaded.entries == {"r/a.pt": full, "r/b.pt": odd}
    assert loaded.get("r/a.pt") == full and loaded.get("r/b.pt") == odd and loaded.get("r/c.pt") is None
    assert decode_snapshot((tmp_path / MANIFEST_NAME).read_bytes(), "manifest")[0] == {"r/a.pt": full, "r/b.pt": odd}
