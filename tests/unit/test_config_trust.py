"""Hostile configs (issue 33, cases 5, 6, 17): a file another user can write is refused, TOML booleans are
not numbers, and a secret is never printed, not in an error and not by check-config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mirrord.config import MASK, load_config, reload_config
from mirrord.errors import ConfigError
from tests.support.cli import run_mirrord
from tests.support.privileges import NOBODY

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"  # noqa: S105 - a made-up key to look for


@pytest.fixture(autouse=True)
def _no_mirrord_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MIRRORD_"):
            monkeypatch.delenv(name)


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "mirrord.toml"
    path.write_text(f'primary = "{tmp_path / "p"}"\nmirror = "{tmp_path / "m"}"\n{body}', encoding="utf-8")
    (tmp_path / "p").mkdir(exist_ok=True)
    (tmp_path / "m").mkdir(exist_ok=True)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's file needs root to make")
@pytest.mark.parametrize("how", ["mode 0666", "owned by nobody", "group-writable, nobody's group"])
def test_a_config_another_user_can_write_is_refused_at_start_and_on_reload(tmp_path: Path, how: str) -> None:
    """A user who cannot touch either volume must not steer a root daemon's retention through its config:
    the file is refused at start, and a reload raises the ConfigError the daemon logs as it keeps the
    old config."""
    path = _config(tmp_path, "[prune]\nkeep_last = 1\nprimary = true\n")
    if how == "mode 0666":
        path.chmod(0o666)
    elif how == "owned by nobody":
        os.chown(path, NOBODY, NOBODY)
        path.chmod(0o644)
    else:
        os.chown(path, 0, NOBODY)
        path.chmod(0o664)
    with pytest.raises(ConfigError) as start:
        load_config(path, environ={})
    with pytest.raises(ConfigError) as reload:
        reload_config(path)
    for refused in (start.value, reload.value):
        [problem] = refused.problems
        assert str(path) in problem and "not trusted" in problem
    path.chmod(0o644)
    os.chown(path, 0, 0)
    assert load_config(path, environ={}).prune.keep_last == 1  # the same file, once only root can write it


def test_a_config_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO in place of the config is refused at once (opened non-blocking), not waited on forever."""
    path = tmp_path / "mirrord.toml"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prune.keep_last", "true"),
        ("prune.min_age_seconds", "false"),
        ("copy.workers", "true"),
        ("prune.keep_every", "true"),
    ],
)
def test_a_toml_boolean_is_not_a_number(tmp_path: Path, key: str, value: str) -> None:
    """`keep_last = true` is refused as the same word from MIRRORD_* is, never taken as 1 (nor false as 0)."""
    section, name = key.split(".")
    path = _config(tmp_path, f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    [problem] = info.value.problems
    assert problem.startswith(f"{key}: ") and "boolean, not a number" in problem and str(path) in problem
    with pytest.raises(ConfigError):
        load_config(
            None,
            environ={"MIRRORD_" + key.replace(".", "__").upper(): value, "MIRRORD_MIRROR": "/m"},
            check_roots=False,
        )


def test_a_refused_secret_variable_is_not_printed(tmp_path: Path) -> None:
    """Refusing MIRRORD_S3__SECRET_ACCESS_KEY (inline secrets not allowed) names the variable, never its value."""
    done = run_mirrord(
        "check-config",
        "--primary",
        tmp_path,
        "--mirror",
        "s3://bucket/prefix",
        env={"MIRRORD_S3__SECRET_ACCESS_KEY": SECRET},
    )
    assert done.returncode == 2
    assert "MIRRORD_S3__SECRET_ACCESS_KEY" in done.stderr
    assert SECRET not in done.stderr + done.stdout


@pytest.mark.parametrize("as_json", [False, True])
def test_check_config_masks_an_allowed_inline_secret(tmp_path: Path, as_json: bool) -> None:
    """An inline secret allowed by s3.allow_inline_credentials is still never printed by check-config."""
    path = tmp_path / "mirrord.toml"
    path.write_text(
        f'primary = "{tmp_path}"\nmirror = "s3://bucket/prefix"\n[s3]\nallow_inline_credentials = true\n'
        f'access_key_id = "AKIDEXAMPLE"\nsecret_access_key = "{SECRET}"\n',
        encoding="utf-8",
    )
    done = run_mirrord("check-config", "--config", path, *(["--format", "json"] if as_json else []))
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "AKIDEXAMPLE" in done.stdout  # only the secret is masked
    if as_json:
        assert json.loads(done.stdout)["s3"]["secret_access_key"] == MASK


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's file needs root to make")
def test_sync_refuses_a_config_others_can_write(tmp_path: Path) -> None:
    """`sync` (read by the fast path, without the models) refuses the same file the daemon does."""
    path = _config(tmp_path, "")
    path.chmod(0o666)
    done = run_mirrord("sync", "--config", path)
    assert done.returncode == 2 and "not trusted" in done.stderr
