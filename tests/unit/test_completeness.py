"""The shell half of completeness (mirrord.store.completeness): what judging remembers between listings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mirrord.core.units import Unit, group_units
from mirrord.layouts import layout_for
from mirrord.store.completeness import Looks, judge
from mirrord.store.scan import snapshot_tree
from mirrord.store.volume import LocalVolume
from tests.support.folders import write_hf

HF = layout_for("hf")


def the_unit(root: Path) -> Unit:
    [unit] = group_units(snapshot_tree(root, HF.patterns, layout=HF).files.values(), HF).values()
    return unit


def test_a_folder_that_lost_files_since_it_was_seen_whole_is_not_whole(tmp_path: Path) -> None:
    """Issue 42 case 6: a whole checkpoint-10/ loses optimizer.pt (its rotation's rmtree under way, or a save
    killed inside it): what is left still passes the hf rule, but it is being deleted, not saved. Written
    afresh (new files), it is a new save and judged as such."""
    folder = tmp_path / "run" / "checkpoint-10"
    write_hf(folder, 10)
    looks = Looks(clock=lambda: 0.0)
    assert judge(LocalVolume(tmp_path), HF, looks=looks)(the_unit(tmp_path)).complete
    (folder / "optimizer.pt").unlink()
    assert judge(LocalVolume(tmp_path), HF)(the_unit(tmp_path)).complete  # no memory: the rule alone says whole
    verdict = judge(LocalVolume(tmp_path), HF, looks=looks)(the_unit(tmp_path))
    assert (verdict.complete, verdict.why) == (
        False,
        "optimizer.pt gone since the folder was seen whole: being deleted, not saved",
    )
    write_hf(folder, 10)
    assert judge(LocalVolume(tmp_path), HF, looks=looks)(the_unit(tmp_path)).complete


def test_a_unit_that_stays_incomplete_is_warned_about_once_per_cause_every_few_minutes(
    tmp_path: Path, logs: list[dict[str, Any]]
) -> None:
    """Issue 42 case 8: a save that died (no trainer_state.json, ever) was warned about on every look (353
    times in 3 minutes). Now: one warning per unit and cause, again after warn_every seconds; a new cause
    (here: the weights gone as well) is warned about at once."""
    folder = tmp_path / "run" / "checkpoint-10"
    write_hf(folder, 10)
    (folder / "trainer_state.json").unlink()
    now = [1000.0]
    looks = Looks(clock=lambda: now[0], warn_every=300)
    for _ in range(353):
        judge(LocalVolume(tmp_path), HF, looks=looks)(the_unit(tmp_path))
        now[0] += 0.5
    warned = [e for e in logs if e["event"] == "unit.incomplete" and e["log_level"] == "warning"]
    assert [e["path"] for e in warned] == ["run/checkpoint-10"]
    now[0] += 300
    judge(LocalVolume(tmp_path), HF, looks=looks)(the_unit(tmp_path))
    (folder / "model.safetensors").unlink()
    (folder / "trainer_state.json").write_text("{}")
    judge(LocalVolume(tmp_path), HF, looks=looks)(the_unit(tmp_path))
    warned = [e["why"] for e in logs if e["event"] == "unit.incomplete" and e["log_level"] == "warning"]
    assert len(warned) == 3 and warned[-1].startswith("no model weights"), warned
