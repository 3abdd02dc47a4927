"""`mirrord drill` on an S3 mirror (a real SeaweedFS): the newest folder unit downloaded into the system temp dir,
checked against the record, loaded by its library, and the scratch copy removed."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_drill import loader_seen
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _config
from tests.support.cli import run_mirrord
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
