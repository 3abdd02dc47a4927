"""Issue 34 item 1 with the real libraries: trainers that rank their own checkpoints (Lightning's
ModelCheckpoint with a monitor, the HF Trainer with load_best_model_at_end) mirrored with prune.mode
"auto" (follow for these layouts) and keep_last 2: the mirror holds exactly what the trainer keeps,
the early best checkpoint included, and a resume from that best on the mirror continues exactly."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from mirrord.store.manifest import Manifest
from tests.integration.test_trainers import assert_no_leftovers, latest_on_mirror, settings, train, unit_names
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for

LIGHTNING_UNIT = re.compile(r"epoch=.*\.ckpt")
HF_UNIT = re.compile(r"checkpoint-\d+")


def wait_mirrored_as_kept(d: DaemonProcess, primary: Path, mirror: Path, unit: re.Pattern[str], also: str = "") -> None:
    """Until the mirror's run holds the units the trainer kept on the primary (and `also`)."""

    def same() -> bool:
        if d.exited():
            raise AssertionError(f"daemon exited:\n{d.log_text()[-4000:]}")
        kept = unit_names(primary, unit)
        return bool(kept) and unit_names(mirror, unit) == kept and (not also or (mirror / also).exists())

    try:
        wait_for(same, 120, "the mirror to hold what the trainer keeps", interval=0.5)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nprimary: {unit_names(primary, unit)}\nmirror: {unit_names(mirror, unit)}\n"
            f"log:\n{d.log_text()[-4000:]}"
        ) from None


@pytest.mark.parametrize("filename", ["", "{epoch}-{val_loss:.2f}"], ids=["step-names", "no-step-names"])
def test_lightning_top_k_best_survives_on_the_mirror_and_resumes(tmp_path: Path, filename: str) -> None:
    """ModelCheckpoint(save_top_k=3, monitor="val_loss") over 6 epochs, val_loss lowest at epoch 0: Lightning
    keeps epochs 0, 4 and 5, and the mirror the same (keep_last 2 would have kept 4 and 5, and with names
    without a step, all six). The best_model_path the mirror's last.ckpt records is on the mirror, and
    Trainer.fit(ckpt_path=<it>) gives steps 3-12 exactly as the run that wrote it."""
    import torch

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    d = DaemonProcess(tmp_path, primary, mirror, settings("lightning"))
    extra = ("--filename", filename) if filename else ()
    try:
        d.start()
        losses = train(
            "train_lightning",
            primary / "run",
            "--epochs",
            6,
            "--keep",
            3,
            "--monitor-best-at",
            0,
            "--step-seconds",
            0.2,
            *extra,
            log=tmp_path / "train.log",
        )
        kept = unit_names(primary / "run", LIGHTNING_UNIT)
        assert len(kept) == 3 and kept[0].startswith("epoch=0-"), kept
        wait_mirrored_as_kept(d, primary / "run", mirror / "run", LIGHTNING_UNIT, also="last.ckpt")
        assert d.stop() == 0
    finally:
        d.kill()
    assert_no_leftovers(mirror)
    newest = latest_on_mirror(mirror, "lightning")  # names without a step: the newest by mtime
    assert newest is not None and torch.load(mirror / newest, map_location="cpu", weights_only=False)["epoch"] == 5
    shutil.rmtree(primary)
    state = torch.load(mirror / "run" / "last.ckpt", map_location="cpu", weights_only=False)
    best = next(v["best_model_path"] for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint"))
    best_on_mirror = mirror / "run" / Path(best).name
    assert best_on_mirror.name == kept[0] and best_on_mirror.is_file()
    resumed = train(
        "train_lightning",
        tmp_path / "resumed",
        "--epochs",
        6,
        "--keep",
        3,
        "--monitor-best-at",
        0,
        "--resume",
        best_on_mirror,
        log=tmp_path / "resumed.log",
    )
    assert resumed == {s: losses[s] for s in range(3, 13)}


def test_hf_trainer_best_checkpoint_survives_its_rotation_on_the_mirror(tmp_path: Path, daemon_factory) -> None:
    """save_total_limit 3, load_best_model_at_end with metric_for_best_model="loss", the scripted eval loss
    lowest at step 2: the Trainer keeps checkpoint-2, -10 and -12, the mirror the same (not keep_last's 10
    and 12); the mirror's newest trainer_state.json names checkpoint-2, and training resumed from the
    mirror's checkpoint-2 gives steps 3 and 4 exactly."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings("hf")).start()
    losses = train(
        "train_hf",
        primary / "run",
        "--steps",
        12,
        "--save-steps",
        2,
        "--save-total-limit",
        3,
        "--best-at",
        2,
        "--step-seconds",
        0.4,
        log=tmp_path / "a.log",
    )
    assert unit_names(primary / "run", HF_UNIT) == ["checkpoint-10", "checkpoint-12", "checkpoint-2"]
    wait_mirrored_as_kept(d, primary / "run", mirror / "run", HF_UNIT)
    print(f"hf follow: deleted on the mirror as the trainer did: {[e['path'] for e in d.events('prune.deleted')]}")
    assert d.stop() == 0
    assert_no_leftovers(mirror)
    shutil.rmtree(primary)
    state = json.loads((mirror / "run" / "checkpoint-12" / "trainer_state.json").read_text())
    best = mirror / "run" / Path(state["best_model_checkpoint"]).name
    assert best.name == "checkpoint-2" and (best / "model.safetensors").is_file()
    resumed = train(
        "train_hf", tmp_path / "resumed", "--steps", 4, "--save-steps", 2, "--resume", best, log=tmp_path / "b.log"
    )
    assert resumed == {s: losses[s] for s in (3, 4)}


def test_lightning_top_k_best_survives_mirrords_own_rotation_of_the_primary(tmp_path: Path) -> None:
    """Issue 42 case 7: ModelCheckpoint(save_top_k=3, monitor="val_loss"), val_loss lowest at epoch 0, with
    prune.primary = true (so mode "auto" is keep_last 2: mirrord rotates the trainer's disk). Before: epoch 0,
    still in Lightning's top 3, was deleted on both sides. Now the ModelCheckpoint state in the newest
    recorded checkpoint (best_k_models, best_model_path) keeps it on both sides, and the start-up line says so."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    prune = {"prune": {"primary": True, "keep_last": 2}}
    d = DaemonProcess(tmp_path, primary, mirror, settings("lightning", **prune))
    try:
        d.start()
        assert "best_k_models" in d.wait_event("daemon.starting")["retention"]
        train(
            "train_lightning",
            primary / "run",
            "--epochs",
            6,
            "--keep",
            3,
            "--monitor-best-at",
            0,
            "--step-seconds",
            0.2,
            log=tmp_path / "train.log",
        )
        best = "epoch=0-step=2.ckpt"
        want = [best, "epoch=4-step=10.ckpt", "epoch=5-step=12.ckpt"]

        def converged() -> bool:
            assert not d.exited(), d.log_text()[-4000:]
            return unit_names(primary / "run", LIGHTNING_UNIT) == unit_names(mirror / "run", LIGHTNING_UNIT) == want

        try:
            wait_for(converged, 120, "both sides pruned to Lightning's top 3", interval=0.5)
        except AssertionError as exc:
            sides = unit_names(primary / "run", LIGHTNING_UNIT), unit_names(mirror / "run", LIGHTNING_UNIT)
            raise AssertionError(f"{exc}\nprimary, mirror: {sides}\n{d.log_text()[-3000:]}") from None
        assert not [e for e in d.events("prune.deleted") if e["path"].endswith(best)]
        assert d.stop() == 0
    finally:
        d.kill()


def test_a_restart_from_scratch_keeps_the_old_runs_tip_under_a_real_daemon(tmp_path: Path, daemon_factory) -> None:
    """Issue 42 case 1, layout hf (follow): checkpoint-500 and -1000 mirrored; the job restarts from scratch in
    the wiped folder and saves a new checkpoint-500. Before, the next prune deleted checkpoint-1000, the old
    run's only copy; now it is kept as the tip of an abandoned branch."""
    import os

    from tests.support.folders import write_hf

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step, age in ((500, 7200), (1000, 3600)):
        for path in write_hf(primary / "run" / f"checkpoint-{step}", step):
            os.utime(path, (path.stat().st_mtime - age,) * 2)
    d = daemon_factory(settings("hf")).start()
    wait_for(lambda: unit_names(mirror / "run", HF_UNIT) == ["checkpoint-1000", "checkpoint-500"], 120, "both mirrored")
    shutil.rmtree(primary / "run")
    write_hf(primary / "run" / "checkpoint-500", 500, width=16)  # the new run: other bytes, written now
    weights = "run/checkpoint-500/model.safetensors"

    def new_500_mirrored() -> bool:
        entry = Manifest.load(mirror).entries.get(weights)
        return entry is not None and entry.size == (primary / weights).stat().st_size

    wait_for(new_500_mirrored, 120, "the new checkpoint-500 mirrored")
    passes = len(d.events("prune.finished"))
    wait_for(lambda: len(d.events("prune.finished")) >= passes + 2, 120, "two prune passes after it")
    assert unit_names(mirror / "run", HF_UNIT) == ["checkpoint-1000", "checkpoint-500"]
    assert not [e for e in d.events("prune.deleted") if "checkpoint-1000" in e["path"]]
    d.wait_event("prune.branch_tip_kept", run="run", step=1000, timeout=10)
    assert d.stop() == 0
