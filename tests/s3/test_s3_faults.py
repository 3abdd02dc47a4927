"""Faults on the way to an object store: the daemon killed mid-upload, the server restarted mid-upload,
a 300 MB checkpoint in 8 MB parts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from mirrord.service.copier import CopyOptions, copy_file
from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _config, _settings
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.gate import FuseMount
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

MIB = 1 << 20


def _big_checkpoint(path: Path, megabytes: int) -> Path:
    """A real torch.save file of about `megabytes` MB (one float32 tensor plus the step)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(megabytes)
    torch.save({"step": 1, "weights": torch.randn(megabytes * MIB // 4)}, path)
    return path


def _uploads(mirror: S3Mirror) -> list[str]:
    """Every multipart upload under the prefix, this mirror's own in flight too."""
    answer = mirror.client.list_multipart_uploads(Bucket=mirror.location.bucket, Prefix=mirror.location.prefix)
    return [up["Key"] for up in answer.get("Uploads", ())]


def test_daemon_killed_mid_upload_leaves_nothing_visible_and_prune_sweeps_it(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path, gated_primary: FuseMount
) -> None:
    """SIGKILL while a gate holds the upload half sent: no object, no manifest entry; prune sweeps the
    upload once the dead daemon's lease and the age guard allow."""
    url = f"s3://{bucket}/{prefix}"
    primary = gated_primary.mount_point
    _big_checkpoint(gated_primary.backing / "run/step_1.pt", 40)
    gated_primary.stall("step_1.pt", after=24 * MIB)
    daemon = DaemonProcess(
        tmp_path,
        primary,
        Path("/unused"),
        env=s3_env,
        settings={"mirror": url, "s3": _settings(seaweed, lease_seconds=10)},
    )
    daemon.settings["mirror"] = url
    daemon.write_config()
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    try:
        daemon.start()
        wait_for(lambda: _uploads(mirror), 120, "a multipart upload under way")
    finally:
        daemon.kill()  # SIGKILL: no abort, no cleanup
        gated_primary.unstall()
    assert mirror.stat("run/step_1.pt") is None  # parts were sent, no object exists
    assert mirror.load_manifest().entries == {}
    assert _uploads(mirror) == [f"{prefix}/run/step_1.pt"]
    config = _config(tmp_path / "prune.toml", primary, url, seaweed, prune={"enabled": True, "min_age_seconds": 3600})
    refused = run_mirrord("prune", "--config", config, env=s3_env, timeout=300)
    assert refused.returncode != 0 and "holds this mirror's lease" in refused.stderr  # the dead daemon's lease
    wait_for(
        lambda: run_mirrord("prune", "--config", config, env=s3_env, timeout=300).returncode == 0,
        120,
        "the dead daemon's lease to expire (10 s)",
        interval=2,
    )
    assert _uploads(mirror) != []  # younger than the age guard: it could be another node's live upload
    config = _config(tmp_path / "prune.toml", primary, url, seaweed, prune={"enabled": True, "min_age_seconds": 0})
    done = run_mirrord("prune", "--config", config, env=s3_env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _uploads(mirror) == []
    assert "s3.stale_upload_aborted" in done.stderr


@pytest.mark.slow
def test_300_mb_in_8_mb_parts_with_bounded_parts_in_flight(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    source = _big_checkpoint(tmp_path / "primary/run/step_1.pt", 300)
    mirror = S3Mirror(
        f"s3://{bucket}/{prefix}", S3Settings(endpoint_url=seaweed.endpoint, part_size=8 * MIB, concurrency=4)
    )
    in_flight: list[int] = []
    upload_part = mirror.client.upload_part
    live = [0]
    lock = threading.Lock()

    def counting_upload_part(**kwargs: Any) -> Any:
        with lock:
            live[0] += 1
            in_flight.append(live[0])
        try:
            return upload_part(**kwargs)
        finally:
            with lock:
                live[0] -= 1

    mirror.client.upload_part = counting_upload_part
    result = copy_file(source.parent.parent, "run/step_1.pt", mirror, CopyOptions())
    assert result.digest == hash_file(source, "blake3")
    assert result.validation == "ok"
    size = source.stat().st_size
    assert len(in_flight) == -(-size // (8 * MIB))  # every part, once
    assert max(in_flight) <= 4  # never more than `concurrency` parts in memory and on the wire
    state = mirror.stat("run/step_1.pt")
    assert state is not None and state.size == size and result.mirror_mtime_ns == state.mtime_ns
    head = mirror.client.head_object(Bucket=bucket, Key=f"{prefix}/run/step_1.pt")
    assert head["ETag"].strip('"').endswith(f"-{len(in_flight)}")  # a multipart object of that many parts


def test_server_restarted_mid_upload_is_retried_and_nothing_is_torn(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path, gated_primary: FuseMount
) -> None:
    """The server restarts while a gate holds the upload half sent: the upload goes on once it is back."""
    source = _big_checkpoint(gated_primary.backing / "run/step_2.pt", 40)
    gated_primary.stall("step_2.pt", after=20 * MIB)
    mirror = S3Mirror(
        f"s3://{bucket}/{prefix}",
        S3Settings(
            endpoint_url=seaweed.endpoint, part_size=5 * MIB, concurrency=2, max_attempts=30, timeout_seconds=600
        ),
    )  # outlasts the restart
    outcome: dict[str, Any] = {}

    def copy() -> None:
        try:
            outcome["result"] = copy_file(gated_primary.mount_point, "run/step_2.pt", mirror, CopyOptions())
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=copy, name="test-s3-copy")
    worker.start()
    try:
        wait_for(lambda: _uploads(mirror), 120, "a multipart upload under way")
        assert "result" not in outcome and "error" not in outcome  # held at the gate: the restart lands mid-upload
        seaweed.restart()
    finally:
        gated_primary.unstall()
        worker.join(600)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].digest == hash_file(source, "blake3")
    with mirror.open_read("run/step_2.pt") as fh:
        from mirrord.store.hashing import new_hasher

        hasher = new_hasher("blake3")
        while chunk := fh.read(MIB):
            hasher.update(chunk)
    assert hasher.hexdigest() == outcome["result"].digest
    assert _uploads(mirror) == []
