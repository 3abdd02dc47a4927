"""An S3 mirror that cannot be used says why: credentials refused, credentials missing, or no server
answering (each of which `latest`, `verify` and `status` used to report as "does not exist")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import tomli_w

from tests.s3.seaweed import SeaweedServer
from tests.support.cli import child_env, mirrord_argv, run_mirrord
from tests.support.ports import free_port

COMMANDS = (["latest"], ["verify"], ["status"])


def _config(tmp_path: Path, url: str, endpoint: str) -> Path:
    (tmp_path / "primary").mkdir(exist_ok=True)
    path = tmp_path / "mirrord.toml"
    path.write_text(
        tomli_w.dumps(
            {
                "primary": str(tmp_path / "primary"),
                "mirror": url,
                "s3": {"endpoint_url": endpoint, "addressing_style": "path", "max_attempts": 1},
                "metrics": {"enabled": False},
            }
        )
    )
    return path


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_wrong_secret_is_named(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path, command: list[str]
) -> None:
    config = _config(tmp_path, f"s3://{bucket}/{prefix}", seaweed.endpoint)
    result = run_mirrord(*command, "--config", config, env={**s3_env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert result.returncode == 1, result.stderr
    assert "the server refused the credentials" in result.stderr, result.stderr
    assert "does not exist" not in result.stderr + result.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_missing_credentials_name_the_variables_to_set(
    bucket: str, prefix: str, seaweed: SeaweedServer, tmp_path: Path, command: list[str]
) -> None:
    config = _config(tmp_path, f"s3://{bucket}/{prefix}", seaweed.endpoint)
    env = {
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_REGION": "us-east-1",
    }
    result = subprocess.run(
        [*mirrord_argv(), *command, "--config", str(config)],
        capture_output=True,
        text=True,
        env=child_env(env, drop=("MIRRORD_", "AWS_")),
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in result.stderr, result.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_closed_port_is_named(s3_env: dict[str, str], tmp_path: Path, command: list[str]) -> None:
    config = _config(tmp_path, "s3://nobucket/p", f"http://127.0.0.1:{free_port()}")
    result = run_mirrord(*command, "--config", config, env=s3_env)
    assert result.returncode == 1, result.stderr
    assert "no answer from the S3 endpoint" in result.stderr, result.stderr


def test_status_of_a_bucket_says_free_space_is_not_reported(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """An object store has no free space: status says so, not `unavailable (None)`."""
    config = _config(tmp_path, f"s3://{bucket}/{prefix}", seaweed.endpoint)
    result = run_mirrord("status", "--config", config, env=s3_env)
    assert "free space not reported (object store)" in result.stdout, result.stdout + result.stderr
    assert "None" not in result.stdout
