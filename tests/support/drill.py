"""The disaster drills: train with the daemon running, wipe the run folder, restore, resume with the library's
own call, and compare with an uninterrupted run; a restart from scratch in the same folder, whose old tip
must survive on the mirror; and the restore drill of every layout, from a local mirror and from S3, with no
config file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mirrord.layouts import layout_for
from mirrord.store.mirror import ReadableStore
from mirrord.store.resume import recorded_candidates, recorded_manifest
from tests.support.cli import child_env, run_mirrord
from tests.support.config import write_config
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


@dataclass(frozen=True)
class Trainer:
    """A trainer of tests/support (`python -m tests.support.MODULE OUT --steps N [--resume UNIT]
    [--stop-after N]`, one JSON line {"step", "loss"} per step, a unit every 2 steps), the layout mirrord
    reads its checkpoints with, and the name of a step's unit in the run folder."""

    module: str
    layout: str
    unit: str  # str.format'ed with the step (and the epoch, {1}, of a Lightning checkpoint)
    options: tuple[str, ...] = ()  # the trainer's own rotation off: every unit lives until it is mirrored
    resumes_from: str = "unit"  # what --resume is: the restored "unit", the "run" folder (the layout's tag
    # file names the unit), or Lightning's "last" (OUT/last.ckpt)
    beside: tuple[str, ...] = ()  # files beside the units that the resume reads (tag file, alias)
    settings: dict[str, Any] = field(default_factory=dict)  # the config the mirror is written with, over layout

    def train(
        self,
        run: Path,
        steps: int,
        resume: Path | str | None = None,
        stop_after: int | None = None,
        save_until: int | None = None,
    ) -> dict[int, float]:
        """Run it as a real process; {step: loss}."""
        argv = [sys.executable, "-m", f"tests.support.{self.module}", str(run), "--steps", str(steps), *self.options]
        argv += ["--resume", str(resume)] if resume is not None else []
        argv += ["--stop-after", str(stop_after)] if stop_after is not None else []
        argv += ["--save-until", str(save_until)] if save_until is not None else []
        env = child_env({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"})
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
        assert done.returncode == 0, f"{self.module} exited {done.returncode}:\n{done.stderr[-4000:]}"
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
        return {e["step"]: e["loss"] for e in events}

    def units(self, *steps: int) -> list[str]:
        """The keys of these steps' units in the run folder `run`."""
        return [f"run/{self.unit.format(step, step // 2 - 1)}" for step in steps]


TORCH = Trainer("train_resume", "torch", "step_{:04d}.pt")
HF = Trainer("train_hf", "hf", "checkpoint-{}", ("--save-total-limit", "0"))
DCP = Trainer("train_dcp", "dcp", "step_{}", ("--keep", "0"))
LIGHTNING = Trainer("train_lightning", "lightning", "epoch={1}-step={0}.ckpt", ("--keep", "-1"), "last", ("last.ckpt",))
DEEPSPEED = Trainer("train_deepspeed", "deepspeed", "global_step{}", ("--keep", "0"), "run", ("latest",))
ACCELERATE = Trainer("train_formats", "accelerate", "checkpoint_{}", ("--layout", "accelerate"))
HF_MODEL = Trainer("train_formats", "hf_model", "checkpoint-{}", ("--layout", "hf_model"))
MEGATRON = Trainer(
    "train_formats", "megatron", "iter_{:07d}", ("--layout", "megatron"), "run", ("latest_checkpointed_iteration.txt",)
)
CUSTOM = Trainer(
    "train_formats",
    "custom",
    "ckpt_{}",
    ("--layout", "custom"),
    settings={
        "patterns": ["ckpt_*"],
        "unit": {"kind": "folder", "complete_marker": "COMMITTED"},
        "prune": {"enabled": False, "step_pattern": r"ckpt_(\d+)"},
    },
)
LAYOUT_TRAINERS = (TORCH, LIGHTNING, HF, HF_MODEL, ACCELERATE, DCP, DEEPSPEED, MEGATRON, CUSTOM)  # as LAYOUTS


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
    seconds). The trainer saves through step 6 and trains on to 12 (its losses are the uninterrupted run's);
    the wipe, then `mirrord restore --mirror M --to PRIMARY` with no config file, then the resume. Asserts: the
    count never drops, the resumed losses equal the uninterrupted run's, the daemon mirrors the new steps and
    copies no old unit again."""
    run = primary / "run"
    with daemon:
        uninterrupted = trainer.train(run, 12, save_until=6)
        counter = UnitCounter(store, trainer.layout)
        wait_for(lambda: counter.count() == 3, 120, "steps 2, 4, 6 verified on the mirror")
        with counter:
            wait_for(lambda: len(counter.counts) >= 3, 30, "the counter running")
            before = counter.counts[-1]
            shutil.rmtree(run)
            started = time.monotonic()
            done = run_mirrord("restore", "--mirror", store.describe(), "--to", primary, env=env, timeout=300)
            restore_seconds = time.monotonic() - started
            assert done.returncode == 0, done.stderr
            restored = Path(done.stdout.strip())
            assert restored == primary / trainer.units(6)[0]
            resumed = trainer.train(run, 12, resume=restored)
            wait_for(lambda: counter.count() == 6, 120, "steps 8, 10, 12 verified on the mirror")
            wait_for(lambda: counter.counts[-1] == 6, 30, "the counter seeing them")
        copied = [e["path"] for e in daemon.events("copy.started")]
    assert all(b >= a for a, b in zip(counter.counts, counter.counts[1:], strict=False)), counter.counts
    assert min(counter.counts) == before == 3
    assert resumed == {step: uninterrupted[step] for step in range(7, 13)}, (resumed, uninterrupted)
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


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def restore_drill(
    tmp_path: Path, trainer: Trainer, s3_url: str, s3: Mapping[str, object], s3_env: dict[str, str]
) -> dict[str, object]:
    """The restore drill of one layout: the trainer trains 6 steps, saving through step 4 only (units 2 and 4: a
    job that died after step 4's save, and its uninterrupted losses); `mirrord sync` mirrors the run into a
    local folder and into S3; the primary is wiped; `mirrord restore --mirror M --to D` with no config
    file brings step 4 back from each, the same files byte for byte (the unit's as saved, and the files beside
    it that the layout's resume reads, pointing at it); the library's own call resumes from the local restore
    at step 5, and steps 5 and 6 have the losses of an uninterrupted run. Returns its figures."""
    primary, run, local = tmp_path / "primary", tmp_path / "primary" / "run", tmp_path / "mirror"
    base = {"primary": str(primary), "layout": trainer.layout, "unit": {"settle_seconds": 0.5}, **trainer.settings}
    base.setdefault("prune", {"enabled": False})
    configs = {
        "local": write_config(tmp_path / "local.toml", {**base, "mirror": str(local)}),
        "s3": write_config(tmp_path / "s3.toml", {**base, "mirror": s3_url, "s3": dict(s3)}),
    }
    unit, name = trainer.units(4)[0], trainer.unit.format(4, 1)
    restore_env = {**s3_env, "AWS_ENDPOINT_URL": str(s3.get("endpoint_url"))}
    seconds: dict[str, float] = {}

    def timed(phase: str, argv: tuple[str | Path, ...]) -> str:
        started = time.monotonic()
        done = run_mirrord(*argv, env=restore_env if argv[0] == "restore" else s3_env, timeout=300)
        seconds[phase] = round(time.monotonic() - started, 2)
        assert done.returncode == 0, f"{phase}: {done.stderr}"
        return done.stdout.strip()

    with ThreadPoolExecutor(2) as pool:  # the two mirrors side by side
        started = time.monotonic()
        uninterrupted = trainer.train(run, 6, save_until=4)  # a job that died right after step 4's save
        seconds["train"] = round(time.monotonic() - started, 2)
        before = _files(run)
        list(pool.map(lambda where: timed(f"sync_{where}", ("sync", "--config", configs[where])), ("local", "s3")))
        shutil.rmtree(primary)
        restores = {"local": (local, primary), "s3": (s3_url, tmp_path / "from_s3")}
        printed = pool.map(
            lambda where: timed(
                f"restore_{where}", ("restore", "--mirror", restores[where][0], "--to", restores[where][1])
            ),
            restores,
        )
        assert [Path(p) for p in printed] == [primary / unit, tmp_path / "from_s3" / unit]
        restored = _files(run)
        assert _files(tmp_path / "from_s3" / "run") == restored
        assert {k: v for k, v in restored.items() if k not in trainer.beside} == {
            k: v for k, v in before.items() if k == name or k.startswith(name + "/")
        }
        for beside in trainer.beside:  # a tag file as saved (it named step 4), an alias a copy of step 4
            assert restored.get(beside) == (restored[name] if beside == "last.ckpt" else before[beside]), beside
        started = time.monotonic()
        resumed = trainer.train(
            run, 6, resume={"unit": primary / unit, "run": run, "last": "last"}[trainer.resumes_from]
        )
        seconds["resume"] = round(time.monotonic() - started, 2)
    assert sorted(resumed) == [5, 6], resumed  # resumed at step 5, not trained again from scratch
    assert resumed == {step: uninterrupted[step] for step in (5, 6)}
    return {**seconds, "restored_files": len(restored)}
