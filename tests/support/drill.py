"""The disaster drill, shared by the local and the S3 mirror: train with the daemon running, wipe the run
folder, restore, resume, and compare with an uninterrupted run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from mirrord.store.mirror import ReadableStore
from mirrord.store.resume import recorded_candidates
from tests.support.cli import child_env, run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


def train(run: Path, steps: int, resume: Path | None = None, stop_after: int | None = None) -> dict[int, str]:
    """Run tests.support.train_resume as a real process; {step: loss as float.hex()}."""
    argv = [sys.executable, "-m", "tests.support.train_resume", "--dir", str(run), "--steps", str(steps)]
    argv += ["--resume", str(resume)] if resume is not None else []
    argv += ["--stop-after", str(stop_after)] if stop_after is not None else []
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True, env=child_env())
    return {int(step): loss for step, loss in (line.split() for line in done.stdout.splitlines())}


class UnitCounter:
    """Counts the mirror's verified units (recorded, every file passed) every 50 ms in a thread."""

    def __init__(self, store: ReadableStore) -> None:
        self.store = store
        self.counts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        return sum(len(units) for units in recorded_candidates(self.store.load_manifest()).values())

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.counts.append(self.count())

    def __enter__(self) -> UnitCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def disaster_drill(tmp_path: Path, daemon: DaemonProcess, primary: Path, store: ReadableStore,
                   env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The drill; returns its figures (units before and after the wipe, the counts seen). Asserts: the
    count never drops, the resumed losses equal the uninterrupted run's, no old unit is copied again."""
    reference = train(tmp_path / "reference", 12)
    run = primary / "run"
    with daemon:
        first = train(run, 12, stop_after=6)
        wait_for(lambda: UnitCounter(store).count() == 3, 120, "steps 2, 4, 6 verified on the mirror")
        with UnitCounter(store) as counter:
            wait_for(lambda: len(counter.counts) >= 3, 30, "the counter running")
            before = counter.counts[-1]
            shutil.rmtree(run)
            done = run_mirrord("restore", "--config", daemon.config_path, env=env, timeout=300)
            assert done.returncode == 0, done.stderr
            restored = Path(done.stdout.strip())
            assert restored == run / "step_0006.pt"
            resumed = train(run, 12, resume=restored)
            wait_for(lambda: counter.count() == 6, 120, "steps 8, 10, 12 verified on the mirror")
            wait_for(lambda: counter.counts[-1] == 6, 30, "the counter seeing them")
        started = [e["path"] for e in daemon.events("copy.started")]
    assert all(b >= a for a, b in zip(counter.counts, counter.counts[1:], strict=False)), counter.counts
    assert min(counter.counts) == before == 3
    assert {**first, **resumed} == reference
    assert sorted(started) == [f"run/step_{s:04d}.pt" for s in (2, 4, 6, 8, 10, 12)], started
    return {"units_before_wipe": before, "units_min_after_wipe": min(counter.counts), "units_end": counter.counts[-1],
            "samples": len(counter.counts)}
