"""An S3 mirror that cannot be used says why: credentials refused, credentials missing, or no server
answering (each of which `latest`, `verify` and `status` used to report as "does not exist")."""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w

from tests.s3.seaweed import SeaweedServer
from tests.support.cli import child_env, mirrord_argv, run_mirrord
from tests.support.ports import free_port

COMMANDS = (["latest"], ["verify"], ["status"])


def _config(tmp_path: Path, url: str, endpoint: str, attempts: int = 1) -> Path:
    (tmp_path / "primary").mkdir(exist_ok=True)
    path = tmp_path / "mirrord.toml"
    path.write_text(
        tomli_w.dumps(
            {
                "primary": str(tmp_path / "primary"),
                "mirror": url,
                "s3": {"endpoint_url": endpoint, "addressing_style": "path", "max_attempts": attempts},
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


@pytest.mark.parametrize("command", [["sync"], ["run"], ["check-config", "--probe"]], ids=lambda c: c[0])
def test_writers_and_the_probe_name_a_wrong_secret_as_latest_does(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path, command: list[str]
) -> None:
    """One translation of botocore's errors: `run` once printed a raw SignatureDoesNotMatch (issue 45.4)."""
    config = _config(tmp_path, f"s3://{bucket}/{prefix}", seaweed.endpoint)
    result = run_mirrord(*command, "--config", config, env={**s3_env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert result.returncode == 1, result.stderr
    assert "the server refused the credentials (" in result.stderr and "check AWS_ACCESS_KEY_ID" in result.stderr


@pytest.fixture
def another_service() -> Iterator[str]:
    """A real HTTP server that is not S3 (the standard library's file server) on a loopback port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize(
    ("command", "request_line"),
    [
        (["latest"], "GET /ckpts with 404 Not Found"),
        (["sync"], "PUT /ckpts/team/.mirrord-leases/"),
        (["run"], "PUT /ckpts/team/.mirrord-leases/"),
        (["check-config", "--probe"], "GET /ckpts with 404 Not Found"),
    ],
    ids=lambda c: c[0] if isinstance(c, list) else "",
)
def test_another_service_at_the_endpoint_is_named_with_what_it_answered(
    another_service: str, s3_env: dict[str, str], tmp_path: Path, command: list[str], request_line: str
) -> None:
    """Not "the mirror does not exist" nor a bare "take lease: 404": the endpoint, the request and the answer
    (issue 45.4)."""
    config = _config(tmp_path, "s3://ckpts/team", another_service)
    result = run_mirrord(*command, "--config", config, env=s3_env)
    assert result.returncode == 1, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("mirrord: ")]
    assert line.startswith(f"mirrord: {another_service}: not an S3 endpoint: it answered {request_line}"), line
    assert line.endswith("and no S3 error; check s3.endpoint_url") and "SimpleHTTP" in line, line


def test_a_command_gives_up_on_a_dead_endpoint_after_a_few_tries_not_max_attempts(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    """A listener that hangs up on every connection: `latest` gives up after two retries at most, where the
    daemon's s3.max_attempts (10 here) kept a person waiting half a minute (issue 45.4)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted: list[int] = []

        def hang_up() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:  # the listener was closed: the test is over
                    return
                accepted.append(1)
                conn.close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        config = _config(tmp_path, "s3://ckpts/team", f"http://127.0.0.1:{listener.getsockname()[1]}", attempts=10)
        result = run_mirrord("latest", "--config", config, env=s3_env)
        listener.shutdown(socket.SHUT_RDWR)
    thread.join(timeout=30)
    assert result.returncode == 1 and "no answer from the S3 endpoint" in result.stderr, result.stderr
    assert 1 <= len(accepted) <= 3


def test_the_probe_writes_reads_back_and_deletes_a_test_object(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], s3_client: object, tmp_path: Path
) -> None:
    """`check-config --probe` on a working bucket, and on a local folder: one line saying what it did, and
    nothing left behind (issue 45.4)."""
    config = _config(tmp_path, f"s3://{bucket}/{prefix}", seaweed.endpoint)
    result = run_mirrord("check-config", "--config", config, "--probe", env=s3_env)
    assert result.returncode == 0, result.stderr
    assert f"probe: wrote, read back and deleted s3://{bucket}/{prefix}/.mirrord-probe-" in result.stdout
    assert s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount") == 0  # type: ignore[attr-defined]
    (tmp_path / "mirror").mkdir()
    local = run_mirrord("check-config", "--primary", tmp_path / "primary", "--mirror", tmp_path / "mirror", "--probe")
    assert local.returncode == 0, local.stderr
    assert f"probe: wrote, read back and deleted {tmp_path / 'mirror'}/.mirrord-probe-" in local.stdout
    assert list((tmp_path / "mirror").iterdir()) == []
