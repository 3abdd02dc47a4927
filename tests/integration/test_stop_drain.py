"""A stop drains what is settled: a checkpoint written just before SIGTERM is mirrored within the grace period,
and one that cannot be is named in the log (stop.left_behind)."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from mirrord.store.resume import latest_checkpoint
from tests.support.daemon import DaemonProcess


def _save_in_place(path: Path, step: int) -> None:
    """torch.save straight to the final name, as many trainers do: the file settles, it is never renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "w": torch.full((256, 256), float(step))}, path)


def test_a_checkpoint_written_just_before_sigterm_is_mirrored(tmp_path: Path) -> None:
    """settle_seconds 2: the file written a moment before SIGTERM gets the rest of its settle time, is copied
    and recorded, and the daemon exits 0 with nothing left behind."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    mirror.mkdir()
    settings = {"copy": {"settle_seconds": 2.0}, "daemon": {"shutdown_grace_seconds": 60}}
    with DaemonProcess(tmp_path, primary, mirror, settings) as daemon:
        _save_in_place(primary / "run" / "step_0001.pt", 1)
        assert daemon.stop(signal.SIGTERM) == 0, daemon.log_text()
    assert latest_checkpoint(mirror, run="run") == mirror / "run" / "step_0001.pt"
    assert (mirror / "run" / "step_0001.pt").read_bytes() == (primary / "run" / "step_0001.pt").read_bytes()
    assert daemon.events("stop.left_behind") == []


def test_a_file_that_cannot_settle_within_the_grace_period_is_named(tmp_path: Path) -> None:
    """settle_seconds 60 and a grace of 1 s: the file is left behind, by name, and the daemon still exits 0."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    mirror.mkdir()
    settings = {"copy": {"settle_seconds": 60.0}, "daemon": {"shutdown_grace_seconds": 1}}
    with DaemonProcess(tmp_path, primary, mirror, settings) as daemon:
        _save_in_place(primary / "run" / "step_0002.pt", 2)
        assert daemon.stop(signal.SIGTERM) == 0, daemon.log_text()
    assert [e["path"] for e in daemon.events("stop.left_behind")] == ["run/step_0002.pt"]
    assert not (mirror / "run" / "step_0002.pt").exists()
