"""`mirror = "s3://bucket/prefix"` and the [s3] section: parsed, checked, credentials from the standard chain."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mirrord.config import load_config
from mirrord.errors import ConfigError
from mirrord.store.s3 import open_s3_mirror
from tests.s3.seaweed import SeaweedServer
from tests.support.cli import run_mirrord


def test_s3_url_survives_a_file_and_keeps_its_slashes(tmp_path: Path) -> None:
    path = tmp_path / "mirrord.toml"
    path.write_text(f'primary = "{tmp_path}"\nmirror = "s3://ckpts/team/run-7"\n[s3]\npart_size = 16777216\n')
    config = load_config(path, environ={})
    assert config.mirror_url == "s3://ckpts/team/run-7"
    assert config.s3.part_size == 16 * 2**20


@pytest.mark.parametrize(
    ("mirror", "message"),
    [
        ("s3://", "no valid bucket name"),
        ("s3://bucket/a/../b", "mirror"),
    ],
)
def test_bad_s3_urls_are_one_line_each(tmp_path: Path, mirror: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, environ={}, overrides={"primary": str(tmp_path), "mirror": mirror})


def test_a_secret_in_the_file_is_refused_unless_allowed_then_warned(tmp_path: Path, logs: list[dict[str, Any]]) -> None:
    base = f'primary = "{tmp_path}"\nmirror = "s3://ckpts/run"\n[s3]\nsecret_access_key = "abc"\n'
    path = tmp_path / "mirrord.toml"
    path.write_text(base)
    with pytest.raises(ConfigError, match=r"s3\.secret_access_key: a secret in the configuration is refused"):
        load_config(path, environ={})
    path.write_text(base + 'access_key_id = "AK"\nallow_inline_credentials = true\n')
    config = load_config(path, environ={})
    mirror = open_s3_mirror(config.mirror_url or "", config.s3)
    assert mirror.settings.secret_access_key == "abc"  # noqa: S105 (the test value above)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["s3.inline_credentials"]


def test_config_to_a_working_mirror(seaweed: SeaweedServer, bucket: str, prefix: str, tmp_path: Path) -> None:
    config = load_config(
        None,
        environ={},
        overrides={
            "primary": str(tmp_path),
            "mirror": f"s3://{bucket}/{prefix}",
            "s3": {"endpoint_url": seaweed.endpoint, "addressing_style": "path", "part_size": 5 * 2**20},
        },
    )
    mirror = open_s3_mirror(config.mirror_url or "", config.s3)
    upload = mirror.begin_upload("run/step_1.pt", 4)
    upload.write(memoryview(b"abcd"))
    upload.seal(0)
    upload.commit()
    assert mirror.describe("run/step_1.pt") == f"s3://{bucket}/{prefix}/run/step_1.pt"
    assert mirror.exists() and mirror.space() is None
    assert list(mirror.snapshot(["*.pt"]).files) == ["run/step_1.pt"]


def test_init_and_check_config_keep_an_s3_url_that_pastes_back(tmp_path: Path) -> None:
    """`init --mirror s3://...` writes the URL as given; check-config prints it with both slashes (TOML and
    JSON), so its output pasted back as a config file reads the same mirror (issue 45.1)."""
    (tmp_path / "p").mkdir()
    written = run_mirrord("init", "--primary", "p", "--mirror", "s3://ckpts/team", "c.toml", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    assert 'mirror = "s3://ckpts/team"' in (tmp_path / "c.toml").read_text().splitlines()
    shown = run_mirrord("check-config", "--config", "c.toml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "pasted.toml").write_text(shown.stdout)
    again = run_mirrord("check-config", "--config", "pasted.toml", "--format", "json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["mirror"] == "s3://ckpts/team"
    flag = run_mirrord(
        "check-config", "--primary", "p", "--mirror", "s3://ckpts/team", "--format", "json", cwd=tmp_path
    )
    assert json.loads(flag.stdout)["mirror"] == "s3://ckpts/team"
