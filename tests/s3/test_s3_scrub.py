"""The scrub of an S3 mirror (issue 43.1): off by default (said once at start-up; no object is read back), and
with `scrub.s3 = true` every object downloaded again and hashed, which finds what no listing can: bytes rotted
on the store's disks under an unchanged size, LastModified and ETag. Either way a rescan finds an object
replaced behind mirrord's back. Real daemons against a real SeaweedFS."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mirrord.commands.sync import run_sync
from mirrord.core.jobs import CopyJob
from mirrord.core.plan import MTIME_TOLERANCE_NS
from mirrord.obs.metrics import Metrics
from mirrord.service.scrub import Scrubber
from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support import config as presets
from tests.support.checkpoints import publish_checkpoint
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_ports
from tests.support.wait import wait_for

EVERY_SECOND = 1 / 86400  # scrub.interval_days: a pass a second


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum SeaweedFS keeps with each needle and checks on every read."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _rot_on_disk(seaweed: SeaweedServer, data: bytes) -> None:
    """One bit of the object holding `data` flipped in SeaweedFS's volume file, and the needle's own CRC sealed
    again over the rotten bytes (as a rewrite of the volume would): the server serves the rotten bytes, while
    the object's size, LastModified, ETag and stored S3 checksum (the filer's metadata) stay as they were.
    A needle (format v3): cookie 4, id 8, size 4, data size 4, data, ..., CRC-32C of the data at 16 + size."""
    found = []
    for volume in seaweed.data.rglob("*.dat"):
        start = volume.read_bytes().find(data)
        if start >= 0:
            found.append((volume, start))
    assert len(found) == 1, found  # (one needle: the object is smaller than a chunk, its bytes are unique)
    volume, start = found[0]
    needle = start - 20
    with volume.open("r+b") as f:
        f.seek(needle + 12)
        body_size, data_size = struct.unpack(">II", f.read(8))
        assert data_size == len(data)
        rotten = bytearray(data)
        rotten[len(data) // 2] ^= 0x10
        f.seek(start)
        f.write(rotten)
        f.seek(needle + 16 + body_size)
        f.write(struct.pack(">I", _crc32c(bytes(rotten))))


def _daemon(tmp_path: Path, primary: Path, url: str, seaweed: SeaweedServer, env: dict[str, str], **extra: Any) -> Any:
    (tmp_path / "d").mkdir(exist_ok=True)
    daemon = DaemonProcess(
        tmp_path / "d",
        primary,
        Path("/unused"),
        env=env,
        settings={"s3": _settings(seaweed), "watch": {"rescan_interval_seconds": 1}, **extra},
    )
    daemon.settings["mirror"] = url
    daemon.write_config()
    return daemon


def test_bytes_rotted_on_the_stores_disk_are_found_by_the_scrub(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Two mirrored checkpoints rot on the server's disk: every listing and HEAD still shows the recorded size,
    LastModified and ETag (no rescan can tell). With scrub.s3 on, the scrub downloads and hashes them: step 1,
    which the primary still holds, is copied again; step 2, which the primary rotated away, is kept, logged
    and counted in mirrord_damaged_copies."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    seed = 10**6 + int(prefix[1:])  # (bytes no other test of the session put on the server)
    steps = {step: publish_checkpoint(primary / "r" / f"step_{step}.pt", step, seed=seed + step) for step in (1, 2)}
    data = {step: path.read_bytes() for step, path in steps.items()}
    mirrored = presets.settings(primary, url, presets.UNIT, {"s3": _settings(seaweed), "prune": {"enabled": False}})
    assert run_sync(presets.load(mirrored)).ok
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    recorded = mirror.load_manifest().entries
    steps[2].unlink()
    for step in (1, 2):
        _rot_on_disk(seaweed, data[step])
        state = mirror.stat(f"r/step_{step}.pt")
        assert state is not None and recorded[f"r/step_{step}.pt"].unchanged(state)  # what a listing shows

    def read(step: int) -> bytes:
        with mirror.open_read(f"r/step_{step}.pt") as stream:
            return stream.read()

    assert read(2) != data[2]
    with _daemon(tmp_path, primary, url, seaweed, s3_env, scrub={"interval_days": EVERY_SECOND, "s3": True}) as d:
        wait_for(lambda: read(1) == data[1], 120, "step 1 copied again", context=lambda: d.log_text()[-3000:])
        assert d.wait_event("scrub.recopy", path="r/step_1.pt", problem="hash_mismatch", timeout=30)
        assert d.wait_event("scrub.damaged", path="r/step_2.pt", problem="hash_mismatch", timeout=120)
        wait_for(lambda: d.metric("mirrord_damaged_copies") == 1, 60, "mirrord_damaged_copies 1")
        wait_for(lambda: d.metric("mirrord_scrub_last_complete_timestamp_seconds"), 60, "a pass completed")
        assert d.metric("mirrord_scrub_bytes_total") > 0
        assert not d.events("scrub.off")
        assert "r/step_2.pt" in mirror.load_manifest().entries  # kept, never deleted
        assert d.stop() == 0


def test_with_the_scrub_off_an_object_replaced_behind_mirrords_back_is_found_by_the_next_rescan(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The default: the daemon says once that the S3 mirror is not scrubbed, and no pass ever completes (the
    gauge stays 0, which the dashboard shows as never). An object rewritten with other bytes of the same
    size gets another LastModified (and ETag): the next rescan's listing shows it, and it is copied again."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    source = publish_checkpoint(primary / "r" / "step_1.pt", 1)
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    with _daemon(tmp_path, primary, url, seaweed, s3_env, scrub={"interval_days": EVERY_SECOND}) as d:
        wait_for(lambda: "r/step_1.pt" in mirror.load_manifest().entries, 120, "mirrored")
        recorded = mirror.load_manifest().entries["r/step_1.pt"]
        # The listing compares size and LastModified with the record, LastModified within MTIME_TOLERANCE_NS (a
        # coarse filesystem's rounding): the rewrite comes later than that. One within it keeps a LastModified
        # the rescan accepts; its ETag differs, so retention holds it unconfirmed and `latest` reads it again.
        later = recorded.stored_mtime_ns + MTIME_TOLERANCE_NS
        wait_for(lambda: _server_time_ns(mirror) > later, 30, "the server's clock past the tolerance")
        rotten = bytearray(source.read_bytes())
        rotten[len(rotten) // 2] ^= 0x10
        mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/r/step_1.pt", Body=bytes(rotten))
        assert d.wait_event("mirror.verify_failed", path="r/step_1.pt", why="mirror_mismatch", timeout=60)

        def copied_again() -> bool:
            with mirror.open_read("r/step_1.pt") as stream:
                return stream.read() == source.read_bytes()

        wait_for(copied_again, 60, "copied again")
        assert len(d.events("scrub.off")) == 1
        assert d.metric("mirrord_scrub_last_complete_timestamp_seconds") == 0
        assert not d.events("scrub.finished") and d.metric("mirrord_scrub_bytes_total") == 0
        assert d.stop() == 0


def _server_time_ns(mirror: S3Mirror) -> int:
    """The server's clock now, in ns, to the second (the Date header of its answer)."""
    from email.utils import parsedate_to_datetime

    answer = mirror.client.list_objects_v2(Bucket=mirror.location.bucket, Prefix=mirror.location.prefix, MaxKeys=1)
    return int(parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()) * 10**9


def test_with_the_scrub_off_no_object_is_downloaded(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Two scrubbers on one mirror, counted on the wire: while the one with scrub.s3 on downloads every object
    twice over (two passes), the one with it off (the default) sends no request at all."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    size = sum(publish_checkpoint(primary / "r" / f"step_{step}.pt", step).stat().st_size for step in (1, 2))
    base = presets.settings(primary, url, presets.UNIT, {"s3": _settings(seaweed), "prune": {"enabled": False}})
    assert run_sync(presets.load(base)).ok
    scrubbers, requests = [], []
    for s3 in (False, True):
        config = presets.load(presets.merge(base, {"scrub": {"interval_days": EVERY_SECOND, "s3": s3}}))
        mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
        manifest = mirror.read_manifest()
        sent: list[tuple[str, str]] = []

        def count(model: Any, params: dict[str, Any], sent: list[tuple[str, str]] = sent, **_: Any) -> None:
            sent.append((model.name, params.get("Key", "")))

        mirror.client.meta.events.register("before-parameter-build.s3", count)
        repairs: list[CopyJob] = []
        scrubbers.append(
            Scrubber(
                lambda c=config: c, mirror, manifest, Metrics(runtime=False), frozenset, lambda: False, repairs.append
            )
        )
        requests.append(sent)
    try:
        for scrubber in scrubbers:
            scrubber.start()
        on = scrubbers[1].metrics.registry
        wait_for(lambda: on.get_sample_value("mirrord_scrub_bytes_total") >= 2 * size, 120, "two passes read")
        wait_for(lambda: on.get_sample_value("mirrord_scrub_last_complete_timestamp_seconds"), 60, "a pass ended")
    finally:
        for scrubber in scrubbers:
            scrubber.stop()
    assert ("GetObject", f"{prefix}/r/step_1.pt") in requests[1]
    assert requests[0] == []
    off = scrubbers[0].metrics.registry
    assert off.get_sample_value("mirrord_scrub_last_complete_timestamp_seconds") == 0


def _scrubber(config: Any, mirror: S3Mirror, manifest: Any, repairs: list[CopyJob]) -> Scrubber:
    return Scrubber(lambda: config, mirror, manifest, Metrics(runtime=False), frozenset, lambda: False, repairs.append)


def _counted(mirror: S3Mirror) -> list[str]:
    """The keys of the objects `mirror` downloads from now on (GetObject, counted on the wire)."""
    got: list[str] = []

    def count(model: Any, params: dict[str, Any], **_: Any) -> None:
        if model.name == "GetObject":
            got.append(params["Key"])

    mirror.client.meta.events.register("before-parameter-build.s3", count)
    return got


def test_an_object_the_store_does_not_serve_is_not_damage(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The endpoint refuses connections while the scrub reads (a server restarting): no object is judged,
    none is copied again, none counted damaged; the next pass reads them again."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    publish_checkpoint(primary / "r" / "step_1.pt", 1)
    base = presets.settings(primary, url, presets.UNIT, {"s3": _settings(seaweed), "prune": {"enabled": False}})
    config = presets.load(presets.merge(base, {"scrub": {"s3": True}}))
    assert run_sync(config).ok
    manifest = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint)).load_manifest()
    refused = f"http://127.0.0.1:{free_ports(1)[0]}"  # (nothing listens there)
    down = S3Mirror(url, S3Settings(endpoint_url=refused, max_attempts=1, timeout_seconds=3))
    repairs: list[CopyJob] = []
    scrubber = _scrubber(config, down, manifest, repairs)
    scrubber.scrub_pass(1e-6)
    assert repairs == []
    assert scrubber.damaged == {}


def test_a_node_reads_back_only_the_objects_it_recorded(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Two nodes share a prefix: each scrubs its own objects (one download of each object per pass, however
    many nodes share it), never another node's, whose source it does not hold."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    publish_checkpoint(primary / "r" / "step_1.pt", 1)
    base = presets.settings(primary, url, presets.UNIT, {"s3": _settings(seaweed, node="node-a")})
    config = presets.load(presets.merge(base, {"scrub": {"s3": True}}))
    assert run_sync(config).ok
    for node, reads in (("node-b", []), ("node-a", [f"{prefix}/r/step_1.pt"])):
        mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, node=node))
        manifest = mirror.load_manifest()
        got, repairs = _counted(mirror), []
        _scrubber(config, mirror, manifest, repairs).scrub_pass(1e-6)
        assert (got, repairs) == (reads, []), node


@contextlib.contextmanager
def _cutting_relay(port: int, after: int) -> Iterator[str]:
    """A TCP relay to 127.0.0.1:`port` that hangs up on each connection once it has passed `after` bytes of
    answers (a connection cut in the middle of an object's body); its endpoint URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    sockets: list[socket.socket] = [listener]
    threads: list[threading.Thread] = []

    def pipe(source: socket.socket, sink: socket.socket, limit: int) -> None:
        passed = 0
        with contextlib.suppress(OSError):
            while passed < limit and (chunk := source.recv(65536)):
                sink.sendall(chunk[: limit - passed])
                passed += len(chunk)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            server = socket.create_connection(("127.0.0.1", port))
            sockets.extend((client, server))
            for args in ((client, server, 1 << 40), (server, client, after)):
                threads.append(threading.Thread(target=pipe, args=args, daemon=True))
                threads[-1].start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        acceptor.join(10)
        for end in sockets[1:]:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(10)
        for end in sockets:
            end.close()


def test_a_connection_cut_in_an_objects_body_is_not_damage(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The connection breaks while the scrub reads an object's body (botocore's own error, not an S3 one): the
    object is not judged (no copy again, nothing damaged) and the scrub goes on, where that error used to end
    its thread."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    size = publish_checkpoint(primary / "r" / "step_1.pt", 1).stat().st_size
    base = presets.settings(primary, url, presets.UNIT, {"s3": _settings(seaweed), "prune": {"enabled": False}})
    config = presets.load(presets.merge(base, {"scrub": {"s3": True}}))
    assert run_sync(config).ok
    manifest = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint)).load_manifest()
    with _cutting_relay(seaweed.ports["s3"], after=size // 2) as endpoint:
        cut = S3Mirror(url, S3Settings(endpoint_url=endpoint, max_attempts=1))
        repairs: list[CopyJob] = []
        scrubber = _scrubber(config, cut, manifest, repairs)
        scrubber.scrub_pass(1e-6)
        assert scrubber.metrics.registry.get_sample_value("mirrord_scrub_bytes_total") < size  # (cut short)
    assert repairs == []
    assert scrubber.damaged == {}
