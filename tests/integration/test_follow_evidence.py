"""Issue 42 cases 2 and 3 under a real daemon (layout hf, prune.mode follow): what the primary lost without the
trainer rotating it (a manual `rm`, a wipe followed by `mirrord restore`) stays on the mirror, pass after pass."""

from __future__ import annotations

import shutil
from pathlib import Path

from mirrord.store.manifest import Manifest
from tests.integration.test_follow import HF_UNIT, wait_mirrored_as_kept
from tests.integration.test_trainers import settings, train, unit_names
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.folders import write_hf
from tests.support.wait import wait_for

ALL = ["checkpoint-100", "checkpoint-200", "checkpoint-300"]


def passes_after(d: DaemonProcess, count: int = 2) -> None:
    """Wait for `count` more retention passes than logged so far."""
    before = len(d.events("prune.finished"))
    wait_for(
        lambda: not d.exited() and len(d.events("prune.finished")) >= before + count,
        120,
        f"{count} more retention passes",
        context=lambda: d.log_text()[-3000:],
    )


def test_a_manual_rm_and_a_wipe_then_restore_keep_the_mirrors_copies(daemon_factory, tmp_path: Path) -> None:
    """checkpoint-100, -200 and -300 mirrored while the daemon watched. An `rm -r` of checkpoint-100 on the
    primary, then a wipe of the run and `mirrord restore --run exp1` (which puts back checkpoint-300): before,
    follow read each as the trainer's rotation and deleted the mirror's only copies at the next pass; now both
    are kept (prune.not_rotated, once each; the held-files gauge), and `prune --forget` lets one go."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "exp1"
    files = max(len(write_hf(run / f"checkpoint-{step}", step)) for step in (100, 200, 300))
    d = daemon_factory(settings("hf")).start()
    wait_for(lambda: unit_names(mirror / "exp1", HF_UNIT) == ALL, 120, "three checkpoints mirrored")
    wait_for(lambda: len(Manifest.load(mirror).entries) >= 3 * files, 60, "all recorded")
    passes_after(d)  # a pass saw the three on the primary, verified: the trainer keeps (at least) three

    shutil.rmtree(run / "checkpoint-100")
    passes_after(d)
    assert unit_names(mirror / "exp1", HF_UNIT) == ALL
    assert d.wait_event("prune.not_rotated", step=100)["run"] == "exp1"
    assert d.metric("mirrord_retention_held_files", 'reason="not_rotated"') == files  # checkpoint-100's

    shutil.rmtree(run)
    done = run_mirrord("restore", "--config", d.config_path, "--run", "exp1", timeout=300)
    assert done.returncode == 0, done.stderr
    assert unit_names(run, HF_UNIT) == ["checkpoint-300"]
    wait_for(lambda: bool(d.events("prune.not_rotated", step=200)), 120, "checkpoint-200 held too")
    passes_after(d)
    assert unit_names(mirror / "exp1", HF_UNIT) == ALL
    assert not d.events("prune.deleted"), d.events("prune.deleted")
    assert len(d.events("prune.not_rotated", step=100)) == 1  # once while it lasts, not at every pass
    assert d.stop() == 0

    forgot = run_mirrord("prune", "--config", d.config_path, "--forget", "exp1:100", timeout=300)
    assert forgot.returncode == 0, forgot.stderr
    assert unit_names(mirror / "exp1", HF_UNIT) == ["checkpoint-200", "checkpoint-300"]


def test_the_hf_trainers_own_rotation_still_leaves_the_mirror(daemon_factory, tmp_path: Path) -> None:
    """The positive case: a real HF Trainer with save_total_limit=2 over 12 steps (a save every 2) rotates
    checkpoint-2 to -8 out while the daemon watches: each leaves the mirror too (the primary was seen holding
    2, and 2 newer saves were recorded after it), and the mirror ends with the trainer's 10 and 12."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings("hf")).start()
    args = ("--steps", 12, "--save-steps", 2, "--save-total-limit", 2, "--step-seconds", 0.4)
    train("train_hf", primary / "run", *args, log=tmp_path / "train.log")
    assert unit_names(primary / "run", HF_UNIT) == ["checkpoint-10", "checkpoint-12"]
    wait_mirrored_as_kept(d, primary / "run", mirror / "run", HF_UNIT)
    deleted = {Path(e["path"]).name for e in d.events("prune.deleted")}
    assert {"checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"} >= deleted - {""} and deleted
    assert not d.events("prune.not_rotated")
    assert d.stop() == 0


def test_a_real_hf_run_wiped_and_restored_keeps_what_its_save_total_limit_keeps(daemon_factory, tmp_path: Path) -> None:
    """Issue 42 case 2 with a real HF Trainer (save_total_limit 3: checkpoint-2, -4 and -6, none rotated yet):
    the run folder is wiped and `mirrord restore --run run` puts back checkpoint-6. Before, the next passes
    deleted -2 and -4 from the mirror, their only copies; now the Trainer's own training_args.bin says it keeps
    3, so they stay. Resumed from the restored checkpoint to step 8, the Trainer would rotate -2 out of a disk
    holding all four: the mirror lets -2 go then, and keeps -4."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "run"
    d = daemon_factory(settings("hf")).start()
    args = ("--steps", 8, "--save-steps", 2, "--save-total-limit", 3)
    train("train_hf", run, *args, "--stop-after", 6, log=tmp_path / "a.log")
    first = ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    wait_for(lambda: unit_names(mirror / "run", HF_UNIT) == first, 120, "three checkpoints mirrored")
    passes_after(d)
    shutil.rmtree(run)
    done = run_mirrord("restore", "--config", d.config_path, "--run", "run", timeout=300)
    assert done.returncode == 0, done.stderr
    assert unit_names(run, HF_UNIT) == ["checkpoint-6"]
    passes_after(d, 3)
    assert unit_names(mirror / "run", HF_UNIT) == first
    assert not d.events("prune.deleted")
    d.wait_event("prune.not_rotated", step=4)
    train("train_hf", run, *args, "--resume", run / "checkpoint-6", log=tmp_path / "b.log")
    want = ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    wait_for(
        lambda: unit_names(mirror / "run", HF_UNIT) == want,
        120,
        "checkpoint-2 rotated out",
        context=lambda: str(unit_names(mirror / "run", HF_UNIT)),
    )
    assert d.stop() == 0
