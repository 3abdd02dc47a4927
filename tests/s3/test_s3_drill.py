"""`mirrord drill` on an S3 mirror (a real SeaweedFS): the newest folder unit downloaded into the system temp dir,
checked against the record, loaded by its library, and the scratch copy removed; the daemon's drills kept in the
bucket across a restart."""

from __future__ import annotations

import json
from pathlib import Path

from mirrord.store.s3 import S3Mirror, S3Settings
from tests.integration.test_drill import loader_seen
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _config, _settings
from tests.support.checkpoints import publish_checkpoint, save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.folders import write_hf


def test_an_s3_mirror_is_drilled_through_the_system_temp_dir(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    primary, temp = tmp_path / "primary", tmp_path / "temp"
    temp.mkdir()
    for step in (10, 20):
        write_hf(primary / "run" / f"checkpoint-{step}", step)
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, "hf", prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    loader = loader_seen(tmp_path, {**s3_env, "TMPDIR": str(temp)}, "--config", config)
    _, layout, scratch, key, *_bounds = loader["argv"]
    assert (layout, key) == ("hf", "run/checkpoint-20")
    assert Path(scratch).parent == temp
    assert list(temp.iterdir()) == []


def test_a_daemon_keeps_its_drills_in_the_s3_mirror_across_a_restart(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The drill's state is an object beside the manifest (.mirrord-drills.json): a daemon restarted on the same
    bucket exports the run's last success at once and does not drill its unit again within the interval; the
    newer unit is drilled (after the first, had the first been forgotten: drilled at once on start)."""
    url, primary = f"s3://{bucket}/{prefix}", tmp_path / "primary"
    save_checkpoint(primary / "run" / "step_10.pt", 10)
    settings = {"mirror": url, "s3": _settings(seaweed), "layout": "torch", "drill": {"interval_hours": 24}}
    first = DaemonProcess(tmp_path, primary, Path("/unused"), settings, env=s3_env)
    with first:
        first.wait_event("drill.passed", 120, run="run")
        passed = first.metric("mirrord_drill_last_success_timestamp_seconds", 'run="run"')
    with S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint)).open_read(".mirrord-drills.json") as kept:
        assert json.load(kept)["runs"]["run"]["ok_at"] == passed

    second = DaemonProcess(tmp_path, primary, Path("/unused"), settings, env=s3_env)
    with second:
        assert second.metric("mirrord_drill_last_success_timestamp_seconds", 'run="run"') == passed
        publish_checkpoint(primary / "run" / "step_20.pt", 20)
        second.wait_event("drill.passed", 120, path="run/step_20.pt")
        assert [e["path"] for e in second.events("drill.passed")] == ["run/step_20.pt"]
