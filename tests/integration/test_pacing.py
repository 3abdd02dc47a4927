"""Pacing from pressure stall information (issue 44) in a real daemon, against a real competing I/O load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mirrord.service.pacing import IO_STALLED, read_pressure
from mirrord.store.manifest import Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for

# The defaults (pacing, idle CPU and I/O priority) over the test preset's full speed.
DEFAULT_IO = {"io": {"pacing": True, "ionice": "idle", "cpu_policy": "idle"}}


def io_pressure() -> str:
    return Path("/proc/pressure/io").read_text()


def io_stalled_avg10() -> float:
    """The share of the last 10 s in which some task waited for I/O ("some avg10=12.34 ..." is 12.34%)."""
    return float(io_pressure().split()[1].removeprefix("avg10=")) / 100


@pytest.mark.skipif(read_pressure() is None, reason="no pressure stall information on this kernel")
@pytest.mark.skipif(shutil.which("stress-ng") is None, reason="stress-ng is not installed")
def test_a_copy_under_a_competing_disk_load_backs_off_and_still_completes(tmp_path: Path, daemon_factory) -> None:
    """A stress-ng disk writer keeps the device busy: the daemon's copy backs off (pacing.backoff, with the
    others' I/O stall that caused it, and mirrord_backoff_seconds_total), yet it completes while the load
    still runs: in the load's quieter moments, or with its floor share once the mirror is more than a save
    interval behind (the run saved every second, by the mirrored checkpoints' mtimes)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step in (1, 2):
        path = publish_checkpoint(primary / "run" / f"step_{step}.pt", step)
        os.utime(path, (time.time() - 60 + step, time.time() - 60 + step))
    d = daemon_factory(DEFAULT_IO).start()
    wait_for(lambda: len(Manifest.load(mirror).entries) == 2, 120, "steps 1 and 2 mirrored")
    load = subprocess.Popen(
        [
            "stress-ng",
            "--hdd",
            "2",
            "--hdd-bytes",
            "256M",
            "--hdd-opts",
            "direct,sync",
            "--temp-path",
            str(tmp_path),
            "--timeout",
            "600s",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # (the totals only grow: the 10 s average says the load now stalls others as the pacer counts a stall)
        wait_for(lambda: io_stalled_avg10() >= IO_STALLED, 120, "the load stalling I/O", 0.2, io_pressure)
        publish_checkpoint(primary / "run" / "step_3.pt", 3, megabytes=256)
        backoff = d.wait_event("pacing.backoff", timeout=120)
        assert backoff["io_stalled"] >= IO_STALLED  # the others' I/O stalls (CPU is not counted at SCHED_IDLE)
        wait_for(lambda: "run/step_3.pt" in Manifest.load(mirror).entries, 240, "step 3 mirrored", 0.2, d.log_text)
        assert load.poll() is None, "the load ended before the copy did: the floor share was not needed"
    finally:
        os.killpg(load.pid, signal.SIGKILL)
        load.wait()
    assert d.metric("mirrord_backoff_seconds_total") > 0
    assert (mirror / "run" / "step_3.pt").read_bytes() == (primary / "run" / "step_3.pt").read_bytes()
    assert d.stop() == 0
