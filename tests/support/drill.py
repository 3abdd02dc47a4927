"""The disaster drills, one per layout, shared by the local and the S3 mirror: train with the daemon running,
wipe the run folder, restore, resume with the library's own call, and compare with an uninterrupted run;
and a restart from scratch in the same folder, whose old tip must survive on the mirror."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mirrord.layouts import layout_for
from mirrord.store.mirror import ReadableStore
from mirrord.store.resume import recorded_candidates, recorded_manifest
from tests.support.cli import child_env, run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


@dataclass(frozen=True)
class Trainer:
    """A trainer of tests/support (`python -m tests.support.MODULE OUT --steps N [--resume UNIT]
    [--stop-after N]`, one JSON line {"step", "loss"} per step, a unit every 2 steps), the layout mirrord
    reads its checkpoints with, and the name of a step's unit in the run folder."""

    module: str
    layout: str
    unit: str  # str.format'ed with the step
    options: tuple[str, ...] = ()  # the trainer's own rotation off: every unit lives until it is mirrored

    def train(
        self, run: Path, steps: int, resume: Path | None = None, stop_after: int | None = None
    ) -> dict[int, float]:
        """Run it as a real process; {step: loss}."""
        argv = [sys.executable, "-m", f"tests.support.{self.module}", str(run), "--steps", str(steps), *self.options]
        argv += ["--resume", str(resume)] if resume is not None else []
        argv += ["--stop-after", str(stop_after)] if stop_after is not None else []
        env = child_env({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"})
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
        assert done.returncode == 0, f"{self.module} exited {done.returncode}:\n{done.stderr[-4000:]}"
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
        return {e["step"]: e["loss"] for e in events}

    def units(self, *steps: int) -> list[str]:
        """The keys of these steps' units in the run folder `run`."""
        return [f"run/{self.unit.format(step)}" for step in steps]


TORCH = Trainer("train_resume", "torch", "step_{:04d}.pt")
HF = Trainer("train_hf", "hf", "checkpoint-{}", ("--save-total-limit", "0"))
DCP = Trainer("train_dcp", "dcp", "step_{}", ("--keep", "0"))


class UnitCounter:
    """Counts the mirror's verified units (recorded, every file passed) every 50 ms in a thread."""

    def __init__(self, store: ReadableStore, layout: str) -> None:
        self.store = store
        self.layout = layout_for(layout)
        self.counts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        return sum(len(units) for units in recorded_candidates(recorded_manifest(self.store, self.layout)).values())

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.counts.append(self.count())

    def __enter__(self) -> UnitCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def drill_daemon(
    tmp_path: Path,
    trainer: Trainer,
    primary: Path,
    mirror: str | Path,
    settings: Mapping[str, object] | None = None,
    env: dict[str, str] | None = None,
) -> DaemonProcess:
    """A daemon (not started) mirroring `primary` with the trainer's layout into `mirror` (a folder or s3://)."""
    primary.mkdir(parents=True, exist_ok=True)
    layers = {"mirror": str(mirror), "layout": trainer.layout, **(settings or {})}
    return DaemonProcess(tmp_path, primary, Path(), layers, env=env)


def disaster_drill(
    tmp_path: Path,
    trainer: Trainer,
    daemon: DaemonProcess,
    primary: Path,
    store: ReadableStore,
    env: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """The drill; returns its figures (units before and after the wipe, the counts seen, the restore's
    seconds). Asserts: the count never drops, the resumed losses equal the uninterrupted run's, the daemon
    mirrors the new steps and copies no old unit again."""
    run = primary / "run"
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(trainer.train, tmp_path / "reference", 12)  # beside the drill: a shorter test
        with daemon:
            first = trainer.train(run, 12, stop_after=6)
            counter = UnitCounter(store, trainer.layout)
            wait_for(lambda: counter.count() == 3, 120, "steps 2, 4, 6 verified on the mirror")
            with counter:
                wait_for(lambda: len(counter.counts) >= 3, 30, "the counter running")
                before = counter.counts[-1]
                shutil.rmtree(run)
                started = time.monotonic()
                done = run_mirrord("restore", "--config", daemon.config_path, env=env, timeout=300)
                restore_seconds = time.monotonic() - started
                assert done.returncode == 0, done.stderr
                restored = Path(done.stdout.strip())
                assert restored == primary / trainer.units(6)[0]
                resumed = trainer.train(run, 12, resume=restored)
                wait_for(lambda: counter.count() == 6, 120, "steps 8, 10, 12 verified on the mirror")
                wait_for(lambda: counter.counts[-1] == 6, 30, "the counter seeing them")
            copied = [e["path"] for e in daemon.events("copy.started")]
        uninterrupted = reference.result()
    assert all(b >= a for a, b in zip(counter.counts, counter.counts[1:], strict=False)), counter.counts
    assert min(counter.counts) == before == 3
    assert {**first, **resumed} == uninterrupted
    assert sorted(copied) == sorted(trainer.units(2, 4, 6, 8, 10, 12)), copied
    return {
        "units_before_wipe": before,
        "units_min_after_wipe": min(counter.counts),
        "units_end": counter.counts[-1],
        "samples": len(counter.counts),
        "restore_seconds": round(restore_seconds, 2),
        "resumed_steps": sorted(resumed),
    }


RETENTION = {"prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 0}}


def restart_drill(
    tmp_path: Path,
    trainer: Trainer,
    daemon: DaemonProcess,
    primary: Path,
    store: ReadableStore,
    env: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """A job that lost its run folder restarts from scratch in the same folder, with the daemon running and
    retention on (keep_last 2; daemon settings RETENTION): the old run's tip (step 8) is never deleted from
    the mirror while the new run saves steps 2, 4, 6 (its 6 replaces the old 6, the same name); retention
    keeps the new run's 4 and 6 and the old tip, and `mirrord restore --step 8` brings the old tip back."""
    run, layout = primary / "run", layout_for(trainer.layout)

    def mirrored() -> list[str]:
        runs = recorded_candidates(recorded_manifest(store, layout))
        return sorted(c.key for units in runs.values() for c in units)

    with daemon:
        trainer.train(run, 12, stop_after=8)
        wait_for(lambda: mirrored() == trainer.units(6, 8), 120, "steps 6 and 8 kept on the mirror")
        tip = (run / trainer.unit.format(8)).read_bytes()
        shutil.rmtree(run)
        trainer.train(run, 12, stop_after=6)  # from scratch: no --resume
        wait_for(
            lambda: mirrored() == sorted(trainer.units(4, 6, 8)),
            120,
            "the new run's 4 and 6 and the old tip kept on the mirror",
            context=lambda: str(mirrored()),
        )
        daemon.wait_event("prune.branch_tip_kept", step=8)
        deleted = [e["path"] for e in daemon.events("prune.deleted")]
    assert trainer.units(8)[0] not in deleted, deleted
    done = run_mirrord(
        "restore", "--config", daemon.config_path, "--step", "8", "--to", tmp_path / "tip", env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == tip
    return {"mirrored_after_restart": mirrored(), "deleted": deleted}
