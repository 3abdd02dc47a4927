"""A real systemd as PID 1 of a container: `systemd-nspawn -b`, commands sent in with nsenter.

The machines that run the tests have no systemd on the host, so nothing is registered with
machined (`--register=no`, `--keep-unit`); the container gets a network of its own with only a
loopback (`--private-network`), where the daemon's metrics listener lives. The unit's IP fence is
enforced in it as on a host (cgroup v2 and bpf() allowed).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from tests.deploy.podman import mounts_under

BOOT_SECONDS = 120
POWEROFF_SECONDS = 60
# Commands run inside get a clean environment: nothing of the test process's (pip settings,
# NOTIFY_SOCKET, ...) leaks into the machine.
INSIDE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Machine:
    """One booted container; `close()` powers it off (or kills it) and checks nothing stays mounted."""

    def __init__(self, root: Path, binds: dict[str, Path], read_only: dict[str, Path], console_log: Path) -> None:
        self.root = root
        self.console_log = console_log
        argv = [
            "systemd-nspawn",
            "--quiet",
            "--directory",
            str(root),
            "--boot",
            "--register=no",
            "--keep-unit",
            "--private-network",
            # systemd enforces IPAddressDeny=/IPAddressAllow= with cgroup BPF programs: it needs bpf()
            # (nspawn's filter refuses it by default) and the unified cgroup hierarchy (the env below, for
            # hosts still on v1), else it skips the fence with only a debug line.
            "--system-call-filter=bpf",
            "--console=pipe",
            "--machine",
            "mirrord-deploy-test",
        ]
        argv += [f"--bind={host}:{inside}" for inside, host in binds.items()]
        argv += [f"--bind-ro={host}:{inside}" for inside, host in read_only.items()]
        self.started = time.monotonic()
        with console_log.open("wb") as log:
            self.nspawn = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"},
            )
        self.leader = 0
        self.boot_seconds = 0.0

    def wait_booted(self) -> None:
        """Wait for PID 1 inside to be systemd and for the boot to finish (running or degraded)."""
        deadline = time.monotonic() + BOOT_SECONDS
        while not self.leader:
            assert self.nspawn.poll() is None, f"systemd-nspawn exited {self.nspawn.returncode}:\n{self.console()}"
            assert time.monotonic() < deadline, f"no systemd started inside:\n{self.console()}"
            self.leader = _child_named(self.nspawn.pid, "systemd")
            if not self.leader:
                time.sleep(0.1)
        # PID 1 answers only once /run/systemd/system and its private socket exist: until then the
        # state is "offline" (not booted with systemd, as far as systemctl can tell) or empty.
        while True:
            result = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=BOOT_SECONDS)
            state = result.stdout.strip()
            if state not in ("", "offline"):
                break
            assert time.monotonic() < deadline, f"systemd never answered: {result.stderr}\n{self.console()}"
            time.sleep(0.2)
        assert state in ("running", "degraded"), f"boot ended {state!r}:\n{self.console()}"
        self.boot_seconds = time.monotonic() - self.started

    def run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a command inside (all of the machine's namespaces), as root."""
        outer = [
            "nsenter",
            "--target",
            str(self.leader),
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--",
            "env",
            "-i",
            f"PATH={INSIDE_PATH}",
            "LANG=C.UTF-8",
            *argv,
        ]
        result = subprocess.run(outer, capture_output=True, text=True, timeout=timeout, check=False)
        if check:
            assert result.returncode == 0, (
                f"{shlex.join(argv)} exited {result.returncode} inside:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        return result

    def sh(self, script: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run("sh", "-euc", script, check=check, timeout=timeout)

    def console(self) -> str:
        return self.console_log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        """Power off through systemd (nspawn turns SIGTERM into an orderly shutdown); kill after a deadline."""
        if self.nspawn.poll() is None:
            os.kill(self.nspawn.pid, signal.SIGTERM)
            try:
                self.nspawn.wait(timeout=POWEROFF_SECONDS)
            except subprocess.TimeoutExpired:
                # Killing the container's PID 1 ends its whole PID namespace; then nspawn itself.
                with contextlib.suppress(ProcessLookupError):
                    if self.leader:
                        os.kill(self.leader, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(timeout=30)
        for mount_point in mounts_under(self.root):
            subprocess.run(["umount", "--lazy", mount_point], capture_output=True, check=False)


def _child_named(parent: int, name: str) -> int:
    """The pid of a child of `parent` whose command name is `name`, or 0."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and comm == name:
            return int(entry.name)
    return 0
