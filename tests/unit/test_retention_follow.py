"""prune.mode = "follow": the mirror keeps what the trainer keeps on the primary (Lightning's top-k, the HF
Trainer's save_total_limit), never more deleted than the trainer deleted, and only once its newest is safe."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from mirrord.config import Config, PruneConfig
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.retention import NO_SIGHTINGS, PrunePlan, PruneRequest, Sightings, plan_prune
from mirrord.layouts import HF_STATE, layout_for
from mirrord.store.aliases import trainer_kept

NOW = 1_700_000_000.0
NS = 1_000_000_000
OLD = int((NOW - 86_400) * NS)
LIGHTNING = layout_for("lightning")


class Sides:
    """Both listings and the manifest: every file mirrored and verified unless said otherwise."""

    def __init__(self) -> None:
        self.primary: dict[str, FileState] = {}
        self.mirror: dict[str, FileState] = {}
        self.manifest: dict[str, ManifestEntry] = {}

    def add(self, rel: str, order: int, primary: bool = True, mirrored: bool = True, mtime: int = 0) -> None:
        mtime = mtime or OLD + order * NS
        state = FileState(rel, 100, mtime, ino=order)
        if primary:
            self.primary[rel] = state
        if mirrored:
            self.mirror[rel] = FileState(rel, 100, mtime, ino=1000 + order)
            self.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", mtime, None, NOW, validation="ok")

    def plan(
        self,
        follow: bool = True,
        keep_last: int = 3,
        layout: str = "lightning",
        pointed: frozenset[str] = frozenset(),
        bookkept: bool = True,
        sightings: Sightings = NO_SIGHTINGS,
        keeps: dict[str, float] | None = None,
    ) -> PrunePlan:
        """`bookkept`: the trainer's newest bookkeeping names all it keeps (Lightning's best_k_models)."""
        rules = layout_for(layout)
        return plan_prune(
            Snapshot(dict(self.primary)),
            Snapshot(dict(self.mirror)),
            dict(self.manifest),
            PruneRequest(
                PruneConfig(keep_last=keep_last, min_age_seconds=300),
                rules.step_regex,
                NOW,
                layout=rules,
                follow=follow,
                pointed=pointed,
                keeps=keeps if keeps is not None else {"run": 0} if bookkept else {},
                sightings=sightings,
            ),
        )


def ckpt(step: int) -> str:
    return f"run/epoch={step // 2 - 1}-step={step}.ckpt"


def top_k(deleted: tuple[int, ...] = (4, 6)) -> Sides:
    """save_top_k=3 over steps 2..10 with step 2 the best: the trainer deleted `deleted`, all were mirrored."""
    sides = Sides()
    for step in (2, 4, 6, 8, 10):
        sides.add(ckpt(step), step, primary=step not in deleted)
    return sides


def test_follow_keeps_the_trainers_set_and_deletes_what_it_deleted() -> None:
    """The trainer keeps 2 (its best), 8 and 10: the mirror keeps exactly those, where keep_last 3 would
    have deleted the best and kept 4 and 6, which the trainer had deleted."""
    sides = top_k()
    plan = sides.plan()
    assert {d.rel for d in plan.deletions} == {ckpt(4), ckpt(6)}
    assert {k.rel for k in plan.kept if k.volume == "mirror"} == {ckpt(2), ckpt(8), ckpt(10)}
    assert {k.why for k in plan.kept if k.rel == ckpt(2)} == {"followed"}
    assert not plan.retired("run", 2) and not plan.retired("run", 4)  # nothing is retired from copying
    keep_last = sides.plan(follow=False)
    assert {d.rel for d in keep_last.deletions} == {ckpt(2), ckpt(4)}  # what follow fixes


def test_nothing_goes_until_the_trainers_newest_is_verified_on_the_mirror() -> None:
    """Step 12 replaced 6 on the primary but is not mirrored yet, or its copy no longer matches: 4 and 6
    stay (the fallback); once 12 is verified they go."""
    sides = top_k()
    sides.add(ckpt(12), 12, mirrored=False)
    plan = sides.plan()
    assert plan.deletions == () and {k.why for k in plan.kept if k.rel == ckpt(6)} == {"newer_unverified"}
    sides.add(ckpt(12), 12)
    assert {d.rel for d in sides.plan().deletions} == {ckpt(4), ckpt(6)}


def test_a_young_checkpoint_the_trainer_deleted_is_kept_by_the_age_guard() -> None:
    """Step 8 was saved 10 s ago, step 10 5 s ago, and the trainer already deleted 8: it stays on the mirror
    for min_age_seconds."""
    sides = top_k(deleted=(8,))
    sides.add(ckpt(8), 8, primary=False, mtime=int((NOW - 10) * NS))
    sides.add(ckpt(10), 10, mtime=int((NOW - 5) * NS))
    plan = sides.plan()
    assert plan.deletions == () and {(s.rel, s.reason) for s in plan.skipped} == {(ckpt(8), "recent_mtime")}


def test_a_primary_that_lost_the_run_pauses_follow() -> None:
    """The run folder is gone from the primary (wiped, unmounted): nothing of it is deleted on the mirror."""
    sides = top_k()
    sides.primary.clear()
    plan = sides.plan()
    assert plan.deletions == () and plan.paused == {"run": 10}


def test_a_pointer_keeps_what_the_trainer_deleted() -> None:
    plan = top_k().plan(pointed=frozenset({ckpt(4)}))
    assert {d.rel for d in plan.deletions} == {ckpt(6)}


def test_names_without_a_step_are_followed_by_the_newest_by_mtime() -> None:
    """filename="{epoch}-{val_loss:.2f}": no step in the names. The trainer keeps two of four and
    last.ckpt; the two it deleted go once its newest (by mtime) is verified on the mirror."""
    sides = Sides()
    names = [f"run/epoch={e}-val_loss={loss}.ckpt" for e, loss in enumerate(("0.10", "0.50", "0.40", "0.30"))]
    for order, rel in enumerate(names):
        sides.add(rel, order, primary=order in (0, 3))
    sides.add("run/last.ckpt", 3)
    plan = sides.plan()
    assert {d.rel for d in plan.deletions} == {names[1], names[2]}
    assert ("mirror", "run/last.ckpt", "no_step") in {(k.volume, k.rel, k.why) for k in plan.kept}
    assert sides.plan(follow=False).deletions == ()  # keep_last never pruned them
    sides.add(names[3], 3, mirrored=False)
    del sides.mirror[names[3]], sides.manifest[names[3]]
    assert sides.plan().deletions == ()  # the trainer's newest is not on the mirror yet


def test_hf_follow_keeps_the_trainers_folders() -> None:
    """save_total_limit 2 with the best at checkpoint-2: the Trainer keeps 2 and 8; 4 and 6 go."""
    sides = Sides()
    for step in (2, 4, 6, 8):
        for name in ("model.safetensors", HF_STATE):
            sides.add(f"run/checkpoint-{step}/{name}", step, primary=step in (2, 8))
    # No bookkeeping names the kept set: the rotation this process saw is the evidence (K = 2: the best and
    # the newest); step 6 goes as 8 and the pinned best are the 2 newer kept.
    seen = Sightings(frozenset(("run", s) for s in (2, 4, 6, 8)), {"run": 2})
    plan = sides.plan(layout="hf", keep_last=1, bookkept=False, sightings=seen, pointed=frozenset({"run/checkpoint-2"}))
    assert {d.unit for d in plan.deletions} == {"run/checkpoint-4", "run/checkpoint-6"}
    unseen = sides.plan(layout="hf", keep_last=1, bookkept=False, pointed=frozenset({"run/checkpoint-2"}))
    assert unseen.deletions == () and unseen.unrotated == (("run", 4), ("run", 6))


def test_the_best_checkpoint_of_the_newest_trainer_state_is_named(tmp_path: Path) -> None:
    layout = layout_for("hf")
    for step, best in ((4, "out/run/checkpoint-2"), (6, "/abs/out/run/checkpoint-4")):
        (tmp_path / "run" / f"checkpoint-{step}").mkdir(parents=True)
        (tmp_path / "run" / f"checkpoint-{step}" / HF_STATE).write_text(json.dumps({"best_model_checkpoint": best}))
    recorded = [f"run/checkpoint-{s}/{HF_STATE}" for s in (4, 6)]
    assert trainer_kept(tmp_path, recorded, layout) == ({"run/checkpoint-4"}, {})
    (tmp_path / "run" / "checkpoint-6" / HF_STATE).write_text("{not json")
    assert trainer_kept(tmp_path, recorded, layout) == (frozenset(), {})


def test_the_mode_in_force_and_why(tmp_path: Path) -> None:
    def config(**kw: object) -> Config:
        return Config(primary=tmp_path, mirror=tmp_path / "m", **kw)  # type: ignore[arg-type]

    assert config(layout="lightning").retention_mode[0] == "follow"
    assert config(layout="hf").retention_mode[0] == "follow"
    assert config(layout="torch").retention_mode[0] == "keep_last"
    mode, why = config(layout="hf", prune={"primary": True}).retention_mode
    assert mode == "keep_last" and "prune.primary" in why
    assert config(prune={"mode": "follow"}).retention_mode == ("follow", "prune.mode = 'follow'")
    with pytest.raises(ValidationError, match="the trainer owns its disk"):
        config(layout="lightning", prune={"mode": "follow", "primary": True})


def test_check_config_prints_the_mode(tmp_path: Path) -> None:
    from tests.support.cli import run_mirrord

    (tmp_path / "p").mkdir()
    out = run_mirrord(
        "check-config",
        "--primary",
        tmp_path / "p",
        "--mirror",
        tmp_path / "m",
        env={"MIRRORD_LAYOUT": "lightning", "MIRRORD_METRICS__ENABLED": "false"},
    )
    assert re.search(r"prune.mode in force is 'follow' \(prune.mode = 'auto': layout 'lightning'", out.stdout), (
        out.stdout + out.stderr
    )


def test_an_explicit_count_the_follow_mode_would_ignore_is_a_config_error(tmp_path: Path) -> None:
    """Issue 42 case 4: layout "hf" with prune.keep_last = 2 and mode "auto" (follow) kept all the trainer kept,
    silently. Now the two keys that disagree are named, with both ways out; keep_last mode takes the count."""

    def config(**prune: object) -> Config:
        return Config(primary=tmp_path, mirror=tmp_path / "m", layout="hf", prune=prune)  # type: ignore[arg-type]

    for key in ("keep_last", "keep_every"):
        with pytest.raises(ValidationError, match=rf'prune.{key}: no effect with prune.mode "follow".*keep_last"'):
            config(**{key: 2})
    with pytest.raises(ValidationError, match=r"prune\.keep_last: no effect"):
        config(keep_last=2, mode="follow")
    assert config(keep_last=2, mode="keep_last").prune.keep_last == 2
    assert config(keep_last=2, primary=True).retention_mode[0] == "keep_last"


def test_check_config_names_the_keys_without_effect(tmp_path: Path) -> None:
    """check-config says which prune keys the mode in force ignores, and refuses an explicit keep_last in follow."""
    from tests.support.cli import run_mirrord

    (tmp_path / "p").mkdir()
    env = {"MIRRORD_LAYOUT": "hf", "MIRRORD_METRICS__ENABLED": "false"}
    args = ("check-config", "--primary", tmp_path / "p", "--mirror", tmp_path / "m")
    out = run_mirrord(*args, env=env)
    assert "# no effect in this mode: prune.keep_last, prune.keep_every\n" in out.stdout, out
    refused = run_mirrord(*args, env={**env, "MIRRORD_PRUNE__KEEP_LAST": "2"})
    assert refused.returncode != 0 and "prune.keep_last: no effect" in refused.stderr, refused
    off = run_mirrord(*args, env={**env, "MIRRORD_PRUNE__ENABLED": "false"})
    assert "# no effect in this mode: prune.mode, prune.keep_last" in off.stdout, off


def test_a_restart_from_scratch_keeps_the_old_runs_tip_in_follow() -> None:
    """Issue 42 case 1: steps 500 and 1000 mirrored; the job restarts from scratch in the same folder (wiped)
    and saves a new step 500, mirrored. Before, follow deleted the old run's 1000, its only copy; now it is
    the tip of an abandoned branch, kept (prune.keep_branch_tips) until the operator forgets it."""
    sides = Sides()
    sides.add(ckpt(500), 1)
    sides.add(ckpt(1000), 2)
    del sides.primary[ckpt(1000)]
    sides.add(ckpt(500), 10)  # the new run's step 500, written after 1000, mirrored and verified
    plan = sides.plan()
    assert plan.deletions == ()
    assert {(k.rel, k.why) for k in plan.kept if k.volume == "mirror"} == {
        (ckpt(500), "followed"),
        (ckpt(1000), "branch_tip"),
    }
    assert plan.branch_tips == {"run": (1000,)}


@pytest.mark.parametrize("ranked", [True, False], ids=["top-k", "no-monitor"])
def test_lightnings_state_names_all_it_keeps_only_when_it_ranks_a_top_k(tmp_path: Path, ranked: bool) -> None:
    """A ModelCheckpoint that ranks (best_k_models filled) names every checkpoint Lightning keeps: its run is
    bookkept, and what it does not name was dropped. Without a monitor best_k_models stays empty (save_top_k
    -1 keeps all, 1 keeps the newest; the state does not say which): the run is not bookkept."""
    import torch

    (tmp_path / "run").mkdir()
    best = str(tmp_path / "run" / "epoch=0-step=2.ckpt")
    state = {"best_k_models": {best: 0.1} if ranked else {}, "best_model_path": best, "last_model_path": ""}
    torch.save({"callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": state}}, tmp_path / ckpt(10))
    named, keeps = trainer_kept(tmp_path, [ckpt(10)], LIGHTNING)
    assert named == {"run/epoch=0-step=2.ckpt"}
    assert keeps == ({"run": 0} if ranked else {})
    sides = Sides()
    for step in (2, 6, 10):
        sides.add(ckpt(step), step, primary=step != 6)
    plan = sides.plan(pointed=named, bookkept=bool(keeps))
    assert {d.rel for d in plan.deletions} == ({ckpt(6)} if ranked else set())
    assert plan.unrotated == (() if ranked else (("run", 6),))


@pytest.mark.parametrize("limit", [2, None], ids=["save_total_limit=2", "unlimited"])
def test_the_hf_trainers_save_total_limit_is_read_from_its_training_args(tmp_path: Path, limit: int | None) -> None:
    """training_args.bin (a real TrainingArguments, torch.save'd as the Trainer does) read without running its
    pickle: with save_total_limit 2 the Trainer rotates out what has 2 newer (or pinned) checkpoints, so 4 and
    6 go, never seen by any daemon; with no limit it keeps all, so nothing gone from the primary goes."""
    import torch
    from transformers import TrainingArguments

    for step in (4, 8):
        (tmp_path / "run" / f"checkpoint-{step}").mkdir(parents=True)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), save_total_limit=limit, report_to=[])
    torch.save(args, tmp_path / "run" / "checkpoint-8" / "training_args.bin")
    (tmp_path / "run" / "checkpoint-8" / HF_STATE).write_text("{}")
    recorded = [f"run/checkpoint-{s}/{HF_STATE}" for s in (4, 8)]
    _named, keeps = trainer_kept(tmp_path, recorded, layout_for("hf"))
    assert keeps == {"run": 2 if limit else float("inf")}
    sides = Sides()
    for step in (2, 4, 6, 8, 10):
        for name in ("model.safetensors", HF_STATE):
            sides.add(f"run/checkpoint-{step}/{name}", step, primary=step in (8, 10))
    plan = sides.plan(layout="hf", keep_last=1, bookkept=False, keeps=keeps)
    gone = {"run/checkpoint-2", "run/checkpoint-4", "run/checkpoint-6"} if limit else set()
    assert {d.unit for d in plan.deletions} == gone
