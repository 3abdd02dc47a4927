"""A gate on a copy's source: a FUSE passthrough (tests/chaos/passthrough.py) whose reads of the files
a test names wait until it opens the gate. A copy is held in flight for as long as the test needs, and
released the moment it says so (never a bandwidth cap that makes a copy last). A mount: `host` tests only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.support.logs import read_events
from tests.support.wait import wait_for

PASSTHROUGH = Path(__file__).resolve().parents[1] / "chaos" / "passthrough.py"


def fuse_unavailable() -> str | None:
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse in this kernel or container"
    if shutil.which("fusermount3") is None:
        return "fusermount3 (Debian fuse3) is not installed"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy (PyPI) or libfuse is not importable: {exc}"
    if os.geteuid() != 0:
        return "mounting needs root here"
    return None


class FuseMount:
    """tests/chaos/passthrough.py serving `backing` at `mount_point`, in its own process."""

    def __init__(self, backing: Path, mount_point: Path, workdir: Path) -> None:
        self.backing, self.mount_point = backing, mount_point
        self.stall_file = workdir / "stall"
        backing.mkdir(parents=True, exist_ok=True)
        mount_point.mkdir(parents=True, exist_ok=True)
        self._log = (workdir / "fuse.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(PASSTHROUGH), str(backing), str(mount_point), str(self.stall_file)],
            stdout=self._log,
            stderr=self._log,
        )
        wait_for(
            lambda: os.path.ismount(mount_point) or self.proc.poll() is not None, 90, "the FUSE mount", interval=0.02
        )
        assert self.proc.poll() is None, (workdir / "fuse.log").read_text()

    def stall(self, *names: str, after: int = 0) -> None:
        """Close the gate on these file names (by base name, `*` for all; any others pass): their stream's reads
        from byte `after` on wait (the bytes before it go through, so a copy can be caught half done; a copy's
        validator, reading the zip's directory beside the stream, is not held)."""
        self.stall_file.write_text("".join(f"{name} {after}\n" for name in names))

    def unstall(self) -> None:
        """Open the gate: every waiting read goes on."""
        self.stall_file.unlink(missing_ok=True)

    def unstall_once_cancelling(self, log: Path, ended: Callable[[], bool] = lambda: False) -> None:
        """Open the gate once the command logging to `log` says it cancels its copies (or `ended()`): a copy
        held in a read sees the cancel only when the read returns, so opened before, it would finish. The
        gate opens even if that never comes (the wait's failure is raised)."""
        try:
            wait_for(
                lambda: read_events(log, "stop.cancelling_copies") or ended(), 90, "the command cancelling its copy"
            )
        finally:
            self.unstall()

    def close(self) -> None:
        self.unstall()
        if os.path.ismount(self.mount_point):
            result = subprocess.run(["fusermount3", "-u", str(self.mount_point)], capture_output=True, check=False)
            if result.returncode != 0:
                subprocess.run(["fusermount3", "-uz", str(self.mount_point)], capture_output=True, check=False)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
