"""The real Dockerfile, built and run with podman: the way the README's Docker section runs it.

The image is built on a Debian stand-in for python:3.11-slim (no registry is reachable here); its
build stage builds mirrord from the sources, offline, with the dependencies' wheels pinned to the
suite's. Each daemon test runs its own container with no network (`--network=none`: only a loopback,
where the HEALTHCHECK asks), /primary bind-mounted read-only and /mirror read-write; the S3 test
shares the host's network to reach SeaweedFS on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mirrord.store.manifest import MANIFEST_NAME
from mirrord.store.s3 import S3Mirror, S3Settings
from tests.deploy.conftest import FIGURES
from tests.deploy.podman import Podman
from tests.s3.seaweed import SeaweedServer
from tests.support.checkpoints import save_checkpoint
from tests.support.logs import parse_events
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

UID = 10001
STOP_TIMEOUT = 45  # the README's `docker run --stop-timeout 45`: more than shutdown_grace_seconds (30 s)


class Container:
    def __init__(self, podman: Podman, name: str, primary: Path, mirror: Path) -> None:
        self.podman, self.name, self.primary, self.mirror = podman, name, primary, mirror

    def inspect(self) -> dict[str, Any]:
        data = json.loads(self.podman.run("container", "inspect", self.name).stdout)
        assert isinstance(data, list) and len(data) == 1
        return dict(data[0])

    def logs(self) -> str:
        result = self.podman.run("logs", self.name, check=False)
        return result.stdout + result.stderr

    def events(self, name: str) -> list[dict[str, Any]]:
        return parse_events(self.logs(), name)


@pytest.fixture
def run_container(podman: Podman, image: str, tmp_path: Path) -> Iterator[Callable[[], Container]]:
    """Start the image as the README does; every container is removed at teardown, even on failure."""
    started: list[str] = []

    def start() -> Container:
        name = f"mirrord-deploy-test-{os.getpid()}-{len(started)}"
        primary, mirror = tmp_path / f"primary{len(started)}", tmp_path / f"mirror{len(started)}"
        primary.mkdir(mode=0o755)
        mirror.mkdir(mode=0o755)
        os.chown(mirror, UID, UID)  # the mirror must belong to the image's user, as on a real volume
        started.append(name)
        podman.run(
            "run",
            "--detach",
            "--name",
            name,
            "--network=none",
            "--stop-timeout",
            str(STOP_TIMEOUT),
            "--volume",
            f"{primary}:/primary:ro",
            "--volume",
            f"{mirror}:/mirror",
            image,
        )
        return Container(podman, name, primary, mirror)

    yield start
    for name in started:
        podman.run("rm", "--force", "--time", "0", name, check=False)


def wait_in(container: Container, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """wait_for, showing the container's log tail on failure."""
    return wait_for(predicate, timeout, what, interval=0.2, context=lambda: container.logs()[-3000:])


def test_runs_as_uid_10001_and_its_healthcheck_turns_healthy(run_container: Callable[[], Container]) -> None:
    """The daemon is uid/gid 10001 (real, effective, saved, filesystem), and the image's own
    HEALTHCHECK command, run by podman, reports healthy once the first reconcile is done."""
    container = run_container()
    state = container.inspect()
    assert state["Config"]["User"] == f"{UID}:{UID}"
    pid = state["State"]["Pid"]
    status = Path(f"/proc/{pid}/status").read_text()
    ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines() if line.startswith(("Uid:", "Gid:"))}
    assert ids == {"Uid": [str(UID)] * 4, "Gid": [str(UID)] * 4}, ids
    assert "python" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()

    def healthy() -> bool:
        # No systemd here to run podman's healthcheck timer: ask for each check as the timer would.
        container.podman.run("healthcheck", "run", container.name, check=False)
        return bool(container.inspect()["State"]["Health"]["Status"] == "healthy")

    wait_in(container, healthy, 120, "HEALTHCHECK healthy")
    health = container.inspect()["State"]["Health"]
    assert health["FailingStreak"] == 0
    assert container.events("daemon.ready")


def test_mirrors_a_dropped_checkpoint_byte_identical(run_container: Callable[[], Container]) -> None:
    """A real torch.save checkpoint renamed into the read-only /primary appears whole in /mirror,
    owned by uid 10001, with its manifest record."""
    container = run_container()
    wait_in(container, lambda: container.events("daemon.ready"), 120, "daemon.ready")
    source = save_checkpoint(container.primary / "run1" / ".step_0007.pt.tmp", 7, width=256, depth=3)
    final = source.with_name("step_0007.pt")
    source.rename(final)  # committed the way trainers do it: renamed into its final name
    mirrored = container.mirror / "run1" / "step_0007.pt"
    wait_in(container, lambda: container.events("copy.committed"), 120, "copy.committed")
    assert mirrored.read_bytes() == final.read_bytes()
    assert mirrored.stat().st_uid == UID
    assert mirrored.stat().st_mtime_ns == final.stat().st_mtime_ns
    # (the daemon then drills the checkpoint: its scratch copy is restored through .part names, then removed)
    wait_in(container, lambda: not list(container.mirror.rglob("*.part")), 120, "no .part left, the drill's too")
    assert (container.mirror / MANIFEST_NAME).is_file()
    assert [p.name for p in container.primary.rglob("*")] == ["run1", "step_0007.pt"], "the primary was written"


def test_podman_stop_ends_it_cleanly_within_the_grace(run_container: Callable[[], Container]) -> None:
    """`podman stop` sends SIGTERM; mirrord stops on its own (exit 0) long before --stop-timeout would
    have it killed (exit 137), and says so in its log."""
    container = run_container()
    wait_in(container, lambda: container.events("daemon.ready"), 120, "daemon.ready")
    assert container.inspect()["Config"]["StopTimeout"] == STOP_TIMEOUT
    started = time.monotonic()
    result = container.podman.run("stop", container.name, timeout=STOP_TIMEOUT + 60, check=False)
    FIGURES["podman stop"] = f"{time.monotonic() - started:.1f} s (grace {STOP_TIMEOUT} s)"
    assert result.returncode == 0, result.stderr
    state = container.inspect()["State"]
    assert (state["Status"], state["ExitCode"], state["OOMKilled"]) == ("exited", 0, False), state
    assert container.events("daemon.stopping") and container.events("daemon.stopped"), container.logs()


def test_syncs_to_an_s3_mirror_from_inside_the_container(
    podman: Podman, image: str, seaweed: SeaweedServer, bucket: str, prefix: str, s3_client: Any, tmp_path: Path
) -> None:
    """The image carries the S3 client: `mirrord sync` in the container, configured by environment
    alone (credentials as AWS_* variables), uploads a real checkpoint to SeaweedFS on the host's
    loopback (`--network=host`) and records it in the manifest, with its content hash."""
    primary = tmp_path / "primary"
    primary.mkdir(mode=0o755)
    source = save_checkpoint(primary / "run1" / "step_0003.pt", 3, width=256, depth=3)
    url = f"s3://{bucket}/{prefix}"
    env = {
        **seaweed.env(),
        "MIRRORD_MIRROR": url,
        "MIRRORD_S3__ENDPOINT_URL": seaweed.endpoint,
        "MIRRORD_S3__ADDRESSING_STYLE": "path",
    }
    env_args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    done = podman.run(
        "run",
        "--rm",
        "--network=host",
        "--volume",
        f"{primary}:/primary:ro",
        *env_args,
        "--entrypoint",
        "mirrord",
        image,
        "sync",
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, addressing_style="path"))
    entries = mirror.load_manifest().entries  # credentials: the s3_env fixture's, in this process's environment
    uploaded = s3_client.get_object(Bucket=bucket, Key=f"{prefix}/run1/step_0003.pt")["Body"].read()
    assert uploaded == source.read_bytes()
    assert set(entries) == {"run1/step_0003.pt"}
    entry = entries["run1/step_0003.pt"]
    assert (entry.size, entry.digest) == (source.stat().st_size, hash_file(source, entry.algo))
