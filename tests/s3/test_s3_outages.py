"""An S3 endpoint that is down, refuses, or accepts and never answers: the daemon stays up and catches up,
and every command a trainer waits on returns within s3.timeout_seconds, naming the real cause (issue 33,
cases 9 and 15). Real `mirrord` processes, a real SeaweedFS stopped and started again, real sockets."""

from __future__ import annotations

import socket
from pathlib import Path

import tomli_w

from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support.checkpoints import save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_ports
from tests.support.wait import wait_for

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "none",
    "AWS_SECRET_ACCESS_KEY": "none",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def test_a_checkpoint_committed_while_the_endpoint_is_down_is_mirrored_once_it_is_back(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The server stops; a checkpoint is committed (the watcher's hint asks the mirror about it). The
    daemon stays up and says so (errors logged, not ready), and once the server is back the checkpoint is
    mirrored and recorded, by the same process."""
    url = f"s3://{bucket}/{prefix}"
    primary = tmp_path / "primary"
    (primary / "run").mkdir(parents=True)
    (tmp_path / "d").mkdir()
    daemon = DaemonProcess(
        tmp_path / "d",
        primary,
        Path("/unused"),
        env=s3_env,
        settings={
            "mirror": url,
            "s3": _settings(seaweed, lease_seconds=20, timeout_seconds=3, max_attempts=2),
            "copy": {"max_attempts": 2, "retry_backoff_seconds": 0.1, "retry_backoff_max_seconds": 1},
            "watch": {"rescan_interval_seconds": 2},
        },
    )
    daemon.settings["mirror"] = url
    daemon.write_config()
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    try:
        daemon.start()
        save_checkpoint(primary / "run/step_1.pt", 1)
        wait_for(lambda: "run/step_1.pt" in mirror.load_manifest().entries, 120, "step 1 recorded")
        seaweed.stop()
        try:
            save_checkpoint(primary / "run/step_2.pt", 2)  # written whole, then renamed into place
            wait_for(
                lambda: daemon.exited() or len(daemon.log_text().split("step_2.pt")) > 2,
                120,
                "the daemon to see step 2 and fail to mirror it",
                context=lambda: daemon.log_text()[-3000:],
            )
            wait_for(lambda: daemon.exited() or daemon.http("/readyz")[0] != 200, 120, "not ready while down")
            assert not daemon.exited(), daemon.log_text()[-3000:]
        finally:
            seaweed.start()
        wait_for(
            lambda: "run/step_2.pt" in mirror.load_manifest().entries,
            180,
            "step 2 recorded once back",
            context=lambda: daemon.log_text()[-3000:],
        )
        assert not daemon.exited()
        with mirror.open_read("run/step_2.pt") as stream:
            assert stream.read() == (primary / "run/step_2.pt").read_bytes()
    finally:
        daemon.stop()


def _config(tmp_path: Path, endpoint: str) -> Path:
    path = tmp_path / "mirrord.toml"
    path.write_text(
        tomli_w.dumps(
            {
                "primary": str(tmp_path),
                "mirror": "s3://bucket/prefix",
                "s3": {"endpoint_url": endpoint, "timeout_seconds": 2},
            }
        )
    )
    return path


def test_latest_against_an_endpoint_that_never_answers_returns_within_its_deadline(tmp_path: Path) -> None:
    """A socket that accepts connections (the kernel's backlog) and never answers: `latest` gives up
    after s3.timeout_seconds (the child's own deadline is a generous bound, never reached) and says the
    endpoint timed out."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        done = run_mirrord("latest", "--config", _config(tmp_path, endpoint), env=CREDENTIALS, timeout=100)
    assert done.returncode == 1, done.stderr
    assert endpoint in done.stderr and "timeout" in done.stderr.lower(), done.stderr
    assert "does not exist" not in done.stderr


def test_latest_against_a_refused_port_names_the_refusal_not_the_bucket(tmp_path: Path) -> None:
    """Nothing listens on the endpoint's port: the message says the connection was refused, with the
    endpoint, and never that the bucket does not exist."""
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"
    done = run_mirrord("latest", "--config", _config(tmp_path, endpoint), env=CREDENTIALS, timeout=100)
    assert done.returncode == 1, done.stderr
    assert endpoint in done.stderr and "refused" in done.stderr.lower(), done.stderr
    assert "does not exist" not in done.stderr
