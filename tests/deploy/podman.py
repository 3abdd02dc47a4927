"""podman with a store, configuration and state of its own, so that the tests never see or touch
anyone else's images or containers, and everything they made goes away at the end."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.conftest import SESSION_MARKER

# Two quirks of the VMs the tests run on, handled here rather than on the machine:
# * root lacks CAP_SYS_RESOURCE, so podman's default rlimits cannot be set (crun/runc: "setrlimit
#   RLIMIT_NOFILE: Operation not permitted"): cap them below the hard limits;
# * cgroup v1 and v2 are mounted side by side ("hybrid"), which Debian's crun 1.8 refuses: use runc.
# No systemd runs as PID 1 there either: cgroupfs manages the cgroups and events go to a file.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
# File locks live in tmp_dir; the default shm locks are one global table shared with every other store.
lock_type = "file"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{home}/events.log"
tmp_dir = "{home}/tmp"
volume_path = "{home}/volumes"
"""
STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{home}/storage"
runroot = "{run_root}"
"""


class Podman:
    """`podman` confined to `home`: its own storage.conf, containers.conf, graph root and run root."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        # podman refuses a run root longer than 50 characters, which one under `home` is as soon as the
        # base temp is a level deeper (a pytest-xdist worker's): the run root is a short folder of its own.
        self.run_root = Path(tempfile.mkdtemp(prefix="mirrord-podman-"))
        (home / "containers.conf").write_text(CONTAINERS_CONF.format(home=home))
        (home / "storage.conf").write_text(STORAGE_CONF.format(home=home, run_root=self.run_root))
        (home / "registries.conf").write_text("unqualified-search-registries = []\n")
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(home),
            "CONTAINERS_CONF": str(home / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(home / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(home / "registries.conf"),
        }
        if SESSION_MARKER in os.environ:  # so that the session's leftover check sees conmon too
            self.env[SESSION_MARKER] = os.environ[SESSION_MARKER]
        # The flags repeat storage.conf: even a podman that ignored the variable stays in `home`.
        self.argv = ["podman", "--root", str(home / "storage"), "--runroot", str(self.run_root)]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [*self.argv, *args]
        result = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout, check=False)
        if check:
            assert result.returncode == 0, (
                f"{shlex.join(['podman', *args])} exited {result.returncode}:\n"
                f"{result.stdout[-2000:]}{result.stderr[-3000:]}"
            )
        return result

    def size(self, image: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image).stdout)

    def close(self) -> None:
        """Remove every container and image, then the store itself; unmount what podman left behind."""
        for args in (("rm", "--all", "--force", "--time", "0"), ("system", "reset", "--force")):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run(*args, timeout=120, check=False)
        for root in (self.home, self.run_root):
            for mount_point in mounts_under(root):
                subprocess.run(["umount", "--lazy", mount_point], capture_output=True, check=False)
            shutil.rmtree(root, ignore_errors=True)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path`, deepest first (the order to unmount them in)."""
    prefix = str(path).rstrip("/") + "/"
    found = []
    with Path("/proc/self/mountinfo").open() as mountinfo:
        for line in mountinfo:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point == str(path) or mount_point.startswith(prefix):
                found.append(mount_point)
    return sorted(found, key=len, reverse=True)
