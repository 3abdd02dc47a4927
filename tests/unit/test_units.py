"""Checkpoint units: grouping a listing per layout, and the completeness rules on the primary."""

from __future__ import annotations

import dataclasses
import json
import pickle
import warnings
from pathlib import Path

import pytest

from mirrord.core.model import FileState
from mirrord.core.plan import SettleTracker
from mirrord.core.units import (
    Completeness,
    Unit,
    completeness,
    dcp_needs,
    group_units,
    locate,
    naming_warnings,
    reads_needed,
)
from mirrord.formats.dcpmeta import MetadataError, storage_references
from mirrord.layouts import LAYOUTS, layout_for, never_matching
from mirrord.store.scan import snapshot_tree
from tests.support.units import stepless


def files(*spec: str | tuple[str, int]) -> list[FileState]:
    out = []
    for item in spec:
        rel, size = (item, 10) if isinstance(item, str) else item
        out.append(FileState(rel, size, 1_700_000_000 * 10**9))
    return out


def test_torch_layout_is_todays_rule() -> None:
    """One file per unit; run = folder; step from step_(\\d+); dot and temp names are never units."""
    layout = layout_for("torch")
    units = group_units(
        files("a/step_10.pt", "a/step_20.pt", "b/final.pt", "a/.step_30.pt", "a/step_40.pt.part", "a/notes.txt"), layout
    )
    assert sorted(units) == ["a/step_10.pt", "a/step_20.pt", "b/final.pt"]
    assert (units["a/step_20.pt"].run, units["a/step_20.pt"].step, units["a/step_20.pt"].kind) == ("a", 20, "file")
    assert units["b/final.pt"].step is None
    assert [u.rel for u in stepless(units.values())] == ["b/final.pt"]


def test_hf_folders_are_units_with_every_file() -> None:
    """checkpoint-N/ is one unit with all its files (subfolders too); the run is the folder above it."""
    layout = layout_for("hf")
    units = group_units(
        files(
            "exp/checkpoint-50/model.safetensors",
            "exp/checkpoint-50/optimizer.pt",
            "exp/checkpoint-50/trainer_state.json",
            "exp/checkpoint-50/fsdp/__0_0.distcp",
            "exp/checkpoint-100/model.safetensors",
            "exp/checkpoint-100.part/model.safetensors",
            "exp/tmp-checkpoint-150/model.safetensors",
            "exp/config.json",
        ),
        layout,
    )
    assert sorted(units) == ["exp/checkpoint-100", "exp/checkpoint-50"]
    unit = units["exp/checkpoint-50"]
    assert (unit.run, unit.step, unit.kind, unit.role) == ("exp", 50, "folder", "checkpoint")
    assert unit.paths == (
        "exp/checkpoint-50/fsdp/__0_0.distcp",
        "exp/checkpoint-50/model.safetensors",
        "exp/checkpoint-50/optimizer.pt",
        "exp/checkpoint-50/trainer_state.json",
    )
    assert unit.member("exp/checkpoint-50/fsdp/__0_0.distcp") == "fsdp/__0_0.distcp"
    assert unit.size == 40


def test_dcp_folders_keep_their_dot_metadata() -> None:
    """`.metadata` belongs to the unit (dcp.load needs it); step_N and step-N both name a step."""
    layout = layout_for("dcp")
    units = group_units(
        files("step_8/__0_0.distcp", "step_8/.metadata", "run/step-12/.metadata", "step_8/.metadata.tmp"), layout
    )
    assert units["step_8"].paths == ("step_8/.metadata", "step_8/__0_0.distcp")
    assert (units["step_8"].run, units["step_8"].step) == ("", 8)
    assert (units["run/step-12"].run, units["run/step-12"].step) == ("run", 12)


def test_lightning_last_ckpt_is_an_alias_without_a_step() -> None:
    layout = layout_for("lightning")
    units = group_units(
        files(
            "lightning_logs/version_0/checkpoints/epoch=4-step=20.ckpt",
            "lightning_logs/version_0/checkpoints/last.ckpt",
        ),
        layout,
    )
    step = units["lightning_logs/version_0/checkpoints/epoch=4-step=20.ckpt"]
    last = units["lightning_logs/version_0/checkpoints/last.ckpt"]
    assert (step.step, step.role) == (20, "checkpoint")
    assert (last.step, last.role) == (None, "alias")
    assert stepless(units.values()) == []  # an alias is not a checkpoint retention would miss


def test_deepspeed_tag_file_rides_beside_its_folders() -> None:
    layout = layout_for("deepspeed")
    units = group_units(
        files(
            "out/global_step100/mp_rank_00_model_states.pt",
            "out/latest",
            "out/global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ),
        layout,
    )
    assert units["out/global_step100"].step == 100
    assert (units["out/latest"].role, units["out/latest"].step) == ("tag", None)


def test_custom_folder_units_use_patterns_and_step_pattern() -> None:
    layout = layout_for("custom", ("ckpt_*",), r"ckpt_(\d+)", "folder", "DONE")
    units = group_units(files("r/ckpt_3/a.bin", "r/ckpt_3/DONE", "r/other/b.bin"), layout)
    assert sorted(units) == ["r/ckpt_3"]
    assert locate("r/ckpt_3/a.bin", layout) is not None
    assert locate("r/other/b.bin", layout) is None


def test_every_layout_builds_and_describes_itself() -> None:
    for name in LAYOUTS:
        layout = layout_for(name)
        assert layout.describe()[0].startswith(f"layout = {name!r}")
    with pytest.raises(ValueError, match="unknown layout"):
        layout_for("keras")


def test_dot_patterns_can_never_match() -> None:
    """check-config's warning: hidden names are never checkpoints, so such a pattern is dead."""
    problems = never_matching(layout_for("custom", (".metadata", "*.pt", "*.part")))
    assert len(problems) == 2
    assert "'.metadata' can never match" in problems[0]
    assert never_matching(layout_for("dcp")) == []


def test_a_custom_folder_without_a_marker_is_said_to_be_a_guess() -> None:
    """check-config: such a folder is whole only by a pause, and the warning says how to know instead."""
    [warning] = never_matching(layout_for("custom", ("ckpt_*",), r"ckpt_(\d+)", "folder"))
    assert "GUESS" in warning and "unit.complete_marker" in warning
    assert never_matching(layout_for("custom", ("ckpt_*",), r"ckpt_(\d+)", "folder", "DONE")) == []


def unit_of(layout_name: str, *spec: str | tuple[str, int]) -> Unit:
    units = group_units(files(*spec), layout_for(layout_name))
    assert len(units) == 1
    return next(iter(units.values()))


def test_settle_rule_waits_for_every_file() -> None:
    unit = unit_of("custom", "step_1.pt")
    assert completeness(unit, layout_for("torch"), quiet=lambda u, guess: False).complete is False
    assert completeness(unit, layout_for("torch")).complete is True


def test_marker_rule() -> None:
    layout = layout_for("custom", ("ckpt_*",), r"ckpt_(\d+)", "folder", "COMPLETE")
    unit = group_units(files("ckpt_1/a.bin"), layout)["ckpt_1"]
    verdict = completeness(unit, layout)
    assert (verdict.complete, verdict.why) == (False, "no COMPLETE marker yet")
    unit = group_units(files("ckpt_1/a.bin", "ckpt_1/COMPLETE"), layout)["ckpt_1"]
    assert completeness(unit, layout).complete is True
    assert (
        completeness(unit, layout, quiet=lambda u, guess: False).why
        == "still being written: a file or the file list changed within the settle time"
    )


def test_hf_rule_needs_a_parsing_trainer_state() -> None:
    layout = layout_for("hf")
    without = unit_of("hf", "checkpoint-5/model.safetensors")
    assert "no trainer_state.json" in completeness(without, layout).why
    assert reads_needed(without, layout) == ()
    unit = unit_of("hf", "checkpoint-5/model.safetensors", "checkpoint-5/trainer_state.json")
    assert reads_needed(unit, layout) == ("checkpoint-5/trainer_state.json",)
    rel = "checkpoint-5/trainer_state.json"
    assert completeness(unit, layout, reads={rel: b'{"global_step": 5'}).complete is False
    assert completeness(unit, layout, reads={rel: b"[1]"}).complete is False
    assert completeness(unit, layout, reads={rel: None}).why == "trainer_state.json could not be read"
    assert completeness(unit, layout, reads={rel: json.dumps({"global_step": 5}).encode()}).complete
    assert not completeness(unit, layout, quiet=lambda u, guess: False, reads={rel: b"{}"}).complete


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dcp.save of a small state dict (single process)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "step_8"
    state = {"model": {"w": torch.randn(16, 8), "b": torch.zeros(8)}, "step": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def test_dcp_metadata_is_read_without_torch_objects(dcp_folder: Path) -> None:
    """The references match the files dcp.save wrote, to the byte."""
    needed = storage_references((dcp_folder / ".metadata").read_bytes())
    assert needed == {"__0_0.distcp": (dcp_folder / "__0_0.distcp").stat().st_size}


def test_dcp_metadata_reader_runs_nothing_a_file_names(tmp_path: Path) -> None:
    """A pickle that calls os.system is read as inert data: nothing runs, and it is not a Metadata."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            import os

            return (os.system, (f"touch {marker}",))

    with pytest.raises(MetadataError):
        storage_references(pickle.dumps(Evil()))
    assert not marker.exists()
    with pytest.raises(MetadataError):
        storage_references(b"\x80\x04\x95garbage")


def test_dcp_rule_checks_every_referenced_file(dcp_folder: Path) -> None:
    layout = layout_for("dcp")
    meta = (dcp_folder / ".metadata").read_bytes()
    size = (dcp_folder / "__0_0.distcp").stat().st_size
    whole = unit_of("dcp", ("step_8/__0_0.distcp", size), ("step_8/.metadata", len(meta)))
    assert reads_needed(whole, layout) == ("step_8/.metadata",)
    assert completeness(whole, layout, reads={"step_8/.metadata": meta}).complete
    short = unit_of("dcp", ("step_8/__0_0.distcp", size - 1), ("step_8/.metadata", len(meta)))
    assert "needs" in completeness(short, layout, reads={"step_8/.metadata": meta}).why
    missing = unit_of("dcp", ("step_8/.metadata", len(meta)))
    assert "missing" in completeness(missing, layout, reads={"step_8/.metadata": meta}).why
    early = unit_of("dcp", ("step_8/__0_0.distcp", size))
    assert "no .metadata yet" in completeness(early, layout).why


def test_an_unreadable_or_foreign_metadata_refuses_the_folder(dcp_folder: Path) -> None:
    """One reading of `.metadata` for the single-node rule and the several-node one: unreadable or not a
    DCP Metadata (here a pickle of something else), the folder is not complete, and the reason says so."""
    meta = (dcp_folder / ".metadata").read_bytes()
    assert dcp_needs(meta) == storage_references(meta)
    unread = dcp_needs(None)
    assert isinstance(unread, Completeness) and not unread.complete
    assert unread.why == ".metadata could not be read"
    foreign = dcp_needs(pickle.dumps({"not": "metadata"}))
    assert isinstance(foreign, Completeness) and not foreign.complete
    assert foreign.why.startswith(".metadata: ")
    size = (dcp_folder / "__0_0.distcp").stat().st_size
    whole = unit_of("dcp", ("step_8/__0_0.distcp", size), ("step_8/.metadata", len(meta)))
    verdict = completeness(whole, layout_for("dcp"), reads={"step_8/.metadata": pickle.dumps([1, 2])})
    assert not verdict.complete and verdict.why.startswith(".metadata: ")


def test_deepspeed_rule_follows_the_tag_file() -> None:
    layout = layout_for("deepspeed")
    unit = group_units(files("o/global_step20/a.pt", "o/global_step10/a.pt"), layout)
    new, old = unit["o/global_step20"], unit["o/global_step10"]
    assert reads_needed(new, layout) == ("o/latest",)
    assert completeness(new, layout, reads={"o/latest": b"global_step20\n"}).complete
    assert completeness(old, layout, reads={"o/latest": b"global_step20"}).complete
    assert not completeness(new, layout, reads={"o/latest": b"global_step10"}).complete
    assert not completeness(new, layout, reads={}).complete


def test_scan_lists_units_per_layout(tmp_path: Path) -> None:
    """Folder layouts: every member (dot names too), staging folders set aside, nothing else."""
    for rel in (
        "run/step_8/__0_0.distcp",
        "run/step_8/.metadata",
        "run/step_9.part/__0_0.distcp",
        "run/notes.txt",
        "run/step_8/.hidden/x",
        "run/step_8/x.tmp",
        "step_3.pt",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    snap = snapshot_tree(tmp_path, (), collect_partials=True, layout=layout_for("dcp"))
    assert sorted(snap.files) == ["run/step_8/.metadata", "run/step_8/__0_0.distcp"]
    assert sorted(snap.staging) == ["run/step_9.part"]
    torch_snap = snapshot_tree(tmp_path, ("*.pt",), layout=layout_for("torch"))
    assert sorted(torch_snap.files) == sorted(snapshot_tree(tmp_path, ("*.pt",)).files) == ["step_3.pt"]


def test_config_layout_key_and_its_conflicts() -> None:
    """`layout` picks the rules; a named layout beside explicit patterns is an error naming both."""
    from mirrord.config import load_config
    from mirrord.errors import ConfigError

    base = {"MIRRORD_MIRROR": "/m"}
    assert load_config(environ=base, check_roots=False).rules == layout_for("torch")
    hf = load_config(environ=base | {"MIRRORD_LAYOUT": "hf"}, check_roots=False)
    assert hf.rules.kind == "folder" and hf.step_regex.pattern == r"^checkpoint-(\d+)$"
    custom = load_config(
        environ=base
        | {"MIRRORD_LAYOUT": "custom", "MIRRORD_UNIT__KIND": "folder", "MIRRORD_UNIT__COMPLETE_MARKER": "DONE"},
        check_roots=False,
    )
    assert (custom.rules.kind, custom.rules.rule, custom.rules.complete_marker) == ("folder", "marker", "DONE")
    with pytest.raises(ConfigError) as err:
        load_config(
            environ=base | {"MIRRORD_LAYOUT": "dcp", "MIRRORD_PATTERNS": "*.distcp", "MIRRORD_UNIT__KIND": "folder"},
            check_roots=False,
        )
    assert err.value.problems == [
        "patterns: layout = 'dcp' names its own checkpoints; use layout = \"custom\" to choose patterns "
        "(from MIRRORD_PATTERNS)",
        "unit: only used with layout = \"custom\" (layout is 'dcp')",
    ]


def test_check_config_prints_the_rules_and_warns_about_dead_patterns(tmp_path: Path) -> None:
    from tests.support.cli import run_mirrord

    (tmp_path / "p").mkdir()
    result = run_mirrord(
        "check-config",
        "--primary",
        tmp_path / "p",
        "--mirror",
        tmp_path / "m",
        env={"MIRRORD_LAYOUT": "custom", "MIRRORD_PATTERNS": ".metadata,*.pt"},
    )
    assert result.returncode == 0, result.stderr
    assert "#   layout = 'custom': a checkpoint is one of the files named ['.metadata', '*.pt']" in result.stdout
    assert "warning: pattern '.metadata' can never match" in result.stderr


def test_folder_plan_is_one_job_per_unit_newest_first_tag_last() -> None:
    """A folder unit is one job listing all its files; an unfinished one waits; DeepSpeed's tag file
    waits until the newest folder of its run is mirrored."""
    from mirrord.core.model import ManifestEntry, Snapshot
    from mirrord.core.plan import plan_unit_copies
    from mirrord.core.units import Completeness
    from tests.support.units import unit_verified

    layout = layout_for("deepspeed")
    primary = Snapshot(
        {f.rel: f for f in files("o/global_step10/a.pt", "o/global_step10/b.pt", "o/global_step20/a.pt", "o/latest")}
    )

    def complete(unit: Unit) -> Completeness:
        return Completeness(unit.step != 20, "")

    plan = plan_unit_copies(primary, Snapshot(), {}, layout, complete)
    assert [(j.rel, j.members) for j in plan.jobs] == [
        ("o/global_step10", ("o/global_step10/a.pt", "o/global_step10/b.pt"))
    ]
    assert plan.unsettled == ("o/global_step20", "o/latest")
    # Once both folders are mirrored and recorded, only the tag file is left.
    entries = {
        rel: ManifestEntry(rel, 10, "blake3", "x", f.mtime_ns, None, 0.0)
        for rel, f in primary.files.items()
        if rel != "o/latest"
    }
    mirror = Snapshot({rel: primary.files[rel] for rel in entries})
    plan = plan_unit_copies(primary, mirror, entries, layout, lambda u: Completeness(True, ""))
    assert [(j.rel, j.members, j.step) for j in plan.jobs] == [("o/latest", (), None)]
    unit = group_units(mirror.files.values(), layout)["o/global_step10"]
    assert unit_verified(unit, entries)
    assert not unit_verified(unit, {k: v for k, v in entries.items() if not k.endswith("b.pt")})
    # A file of the mirrored folder the primary no longer has: the folder is published again whole.
    extra = Snapshot({**mirror.files, "o/global_step10/c.pt": FileState("o/global_step10/c.pt", 1, 1)})
    plan = plan_unit_copies(primary, extra, entries, layout, lambda u: Completeness(True, ""))
    assert [(j.rel, j.why) for j in plan.jobs] == [("o/global_step10", "changed"), ("o/latest", "new")]


def test_a_folder_being_rotated_away_never_replaces_its_whole_mirrored_copy() -> None:
    """The trainer deletes an old folder file by file: a listing in between shows it with fewer files,
    all unchanged. The mirror's copy (every file recorded) stays as it is: not planned again."""
    from mirrord.core.model import ManifestEntry, Snapshot
    from mirrord.core.plan import plan_unit_copies
    from mirrord.core.units import Completeness

    layout = layout_for("deepspeed")
    whole = {f.rel: f for f in files("o/global_step10/a.pt", "o/global_step10/b.pt")}
    entries = {rel: ManifestEntry(rel, 10, "blake3", "x", f.mtime_ns, None, 0.0) for rel, f in whole.items()}
    halfway = Snapshot({"o/global_step10/a.pt": whole["o/global_step10/a.pt"]})
    plan = plan_unit_copies(halfway, Snapshot(whole), entries, layout, lambda u: Completeness(True, ""))
    assert plan.jobs == () and plan.in_sync == 1


def test_file_layouts_plan_exactly_as_before() -> None:
    from mirrord.core.model import Snapshot
    from mirrord.core.plan import plan_copies, plan_unit_copies
    from mirrord.core.units import Completeness

    primary = Snapshot({f.rel: f for f in files("a/step_1.pt", "a/step_2.pt", "b.pt")})
    layout = layout_for("torch")
    assert plan_unit_copies(primary, Snapshot(), {}, layout, lambda u: Completeness(True, "")) == plan_copies(
        primary, Snapshot(), {}, layout.step_regex
    )


def test_staged_folder_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    """Staged in the hidden staging area; NAME/ after commit; abort leaves nothing; commit replaces, never
    merges; a NAME.part/ left in a run folder by an older version is removed without following links."""
    from mirrord.store.scan import state_from_stat
    from mirrord.store.staging import FolderStaging, remove_folder

    staging = FolderStaging(tmp_path, "run/checkpoint-1")
    up = staging.upload("sub/a.bin", 3)
    up.write(memoryview(b"abc"))
    up.seal(1_700_000_000 * 10**9)
    up.commit()
    assert (tmp_path / staging.staging_key / "sub/a.bin").read_bytes() == b"abc"
    assert not (tmp_path / "run/checkpoint-1").exists()
    staging.commit()
    assert (tmp_path / "run/checkpoint-1/sub/a.bin").read_bytes() == b"abc"
    assert not (tmp_path / staging.staging_key).exists()
    again = FolderStaging(tmp_path, "run/checkpoint-1")  # published again: replaces the old one whole
    up = again.upload("b.bin", 1)
    up.write(memoryview(b"b"))
    up.seal(1_700_000_000 * 10**9)
    up.commit()
    again.commit()
    assert [p.name for p in (tmp_path / "run/checkpoint-1").iterdir()] == ["b.bin"]  # nothing merged
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-1"]
    (tmp_path / "run/checkpoint-3").write_bytes(b"a file where the unit goes")
    blocked = FolderStaging(tmp_path, "run/checkpoint-3")
    with pytest.raises(FileExistsError):
        blocked.commit()
    blocked.abort()
    (tmp_path / "run/checkpoint-3").unlink()
    (tmp_path / "run/checkpoint-2.part").mkdir()  # an older version's staging, beside its final name
    state = state_from_stat("run/checkpoint-2.part", (tmp_path / "run/checkpoint-2.part").stat())
    (tmp_path / "run/checkpoint-2.part/x").write_bytes(b"x")
    (tmp_path / "outside").write_bytes(b"keep")
    (tmp_path / "run/checkpoint-2.part/link").symlink_to(tmp_path / "outside")
    assert remove_folder(tmp_path, "run/checkpoint-2.part", state)
    assert (tmp_path / "outside").read_bytes() == b"keep"  # a symlink inside is removed, never followed
    assert not remove_folder(tmp_path, "run/checkpoint-1")  # not empty: left


def test_alias_symlink_recreated_only_once_its_target_is_recorded(tmp_path: Path) -> None:
    """Lightning's save_last="link": last.ckpt -> a step in the same folder is made on the mirror as the
    same relative link, only once that step is in the manifest; a link leading elsewhere never is."""
    from mirrord.core.model import ManifestEntry
    from mirrord.store.aliases import alias_links, mirror_alias_links

    primary, mirror = tmp_path / "p", tmp_path / "m"
    (primary / "ck").mkdir(parents=True)
    (mirror / "ck").mkdir(parents=True)
    (primary / "ck" / "epoch=0-step=5.ckpt").write_bytes(b"x")
    (primary / "ck" / "last.ckpt").symlink_to("epoch=0-step=5.ckpt")
    (primary / "ck" / "escape.ckpt").symlink_to("/etc/passwd")
    snap = snapshot_tree(primary, ("*.ckpt",), layout=layout_for("lightning"))
    links = alias_links(snap.skipped, layout_for("lightning"))
    assert links == ["ck/last.ckpt"]
    assert mirror_alias_links(primary, mirror, links, {}) == []
    assert not (mirror / "ck" / "last.ckpt").is_symlink()
    entry = ManifestEntry("ck/epoch=0-step=5.ckpt", 1, "blake3", "x", 0, 5, 0.0)
    assert mirror_alias_links(primary, mirror, links, {entry.path: entry}) == [("ck/last.ckpt", "epoch=0-step=5.ckpt")]
    assert (mirror / "ck" / "last.ckpt").readlink() == Path("epoch=0-step=5.ckpt")
    assert mirror_alias_links(primary, mirror, links, {entry.path: entry}) == []  # already there


def test_a_watch_event_is_routed_to_the_unit_it_lies_in() -> None:
    from mirrord.core.units import unit_of

    hf, ds, torch_layout = layout_for("hf"), layout_for("deepspeed"), layout_for("torch")
    assert unit_of("run/checkpoint-5/optimizer.pt", hf) == "run/checkpoint-5"
    assert unit_of("run/checkpoint-5/sub/shard.bin", hf) == "run/checkpoint-5"
    assert unit_of("run/checkpoint-5", hf) == "run/checkpoint-5"  # the folder itself (renamed into place)
    assert unit_of("run/checkpoint-5.part/optimizer.pt", hf) is None  # our staging, on a mirror
    assert unit_of("run/notes.txt", hf) is None
    assert unit_of("run", hf) is None  # a run folder: no unit of its own (a rescan, then)
    assert unit_of("out/latest", ds) == "out/latest"
    assert unit_of("out/zero_to_fp32.py", ds) is None
    assert unit_of("a/step_3.pt", torch_layout) == "a/step_3.pt"
    assert unit_of("a/notes.txt", torch_layout) is None


def test_one_unit_folder_is_listed_as_the_whole_tree_lists_it(tmp_path: Path) -> None:
    """Every member (dot names too, temp names not), below sub-folders, never through a symlink; a unit
    that is gone, or a symlink, lists empty."""
    from mirrord.store.scan import snapshot_unit, unit_folders

    layout = layout_for("dcp")
    unit = tmp_path / "run" / "step_4"
    (unit / "sub").mkdir(parents=True)
    for rel in ("__0_0.distcp", ".metadata", "sub/extra.bin", "x.tmp"):
        (unit / rel).write_bytes(b"x")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret").write_bytes(b"s")
    (unit / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "run" / "step_9").symlink_to(tmp_path / "elsewhere")
    whole = snapshot_tree(tmp_path, layout.patterns, layout=layout)
    listed = snapshot_unit(tmp_path, "run/step_4", layout)
    assert (
        sorted(listed.files)
        == sorted(whole.files)
        == ["run/step_4/.metadata", "run/step_4/__0_0.distcp", "run/step_4/sub/extra.bin"]
    )
    assert listed.files == whole.files
    assert snapshot_unit(tmp_path, "run/step_9", layout).files == {}
    assert snapshot_unit(tmp_path, "run/step_77", layout).files == {}
    assert unit_folders(tmp_path, "run", layout) == ["run/step_4"]
    assert unit_folders(tmp_path, "gone", layout) == []


def test_a_lightning_alias_waits_for_the_newest_step_then_names_its_twins() -> None:
    """last.ckpt is planned only once the newest step of its run is mirrored (it is most likely that
    step's bytes), with the mirrored steps of its size as twins, newest first; other runs' never."""
    from mirrord.core.model import ManifestEntry, Snapshot
    from mirrord.core.plan import plan_unit_copies

    layout = layout_for("lightning")
    t = 1_700_000_000 * 10**9
    listed = [
        FileState("r/epoch=0-step=2.ckpt", 100, t),
        FileState("r/epoch=1-step=4.ckpt", 100, t + 1),
        FileState("r/last.ckpt", 100, t + 2),
        FileState("o/epoch=0-step=2.ckpt", 100, t),
    ]
    primary = Snapshot({s.rel: s for s in listed})

    def recorded(*rels: str) -> dict[str, ManifestEntry]:
        return {
            rel: ManifestEntry(
                rel, 100, "blake3", rel, primary.files[rel].mtime_ns, layout.step_of(rel), 1.0, validation="ok"
            )
            for rel in rels
        }

    def plan(manifest: dict[str, ManifestEntry]):  # type: ignore[no-untyped-def]
        mirror = Snapshot({rel: primary.files[rel] for rel in manifest})
        return plan_unit_copies(primary, mirror, manifest, layout, lambda u: completeness(u, layout))

    waiting = plan(recorded("r/epoch=0-step=2.ckpt", "o/epoch=0-step=2.ckpt"))
    assert "r/last.ckpt" in waiting.unsettled and [j.rel for j in waiting.jobs] == ["r/epoch=1-step=4.ckpt"]
    ready = plan(recorded("r/epoch=0-step=2.ckpt", "r/epoch=1-step=4.ckpt", "o/epoch=0-step=2.ckpt"))
    [job] = ready.jobs
    assert (job.rel, job.step, job.twins) == ("r/last.ckpt", None, ("r/epoch=1-step=4.ckpt", "r/epoch=0-step=2.ckpt"))
    other = dict(recorded("r/epoch=0-step=2.ckpt", "r/epoch=1-step=4.ckpt"))
    other["r/epoch=0-step=2.ckpt"] = dataclasses.replace(other["r/epoch=0-step=2.ckpt"], size=99)  # not its size
    assert [j.twins for j in plan(other).jobs if j.rel == "r/last.ckpt"] == [("r/epoch=1-step=4.ckpt",)]


def test_checkpoint_like_names_are_warned_once_per_pattern_with_the_layout_that_selects_them() -> None:
    """naming_warnings: checkpoints with no step (one per layout pattern), and files the layout did not
    select that look like another stack's checkpoints (one per lookalike pattern), each naming a path."""
    from mirrord.core.model import Snapshot
    from mirrord.core.units import naming_warnings
    from mirrord.layouts import lookalike_folder, lookalike_name

    def lookalike(rel: str) -> str | None:  # as the scanner asks: by the folders, then by the name
        folder, _, name = rel.rpartition("/")
        return lookalike_name(name, lookalike_folder(folder))

    assert lookalike("r/checkpoint-5/model.safetensors") == "checkpoint-N/"
    assert lookalike("r/global_step9/mp_rank_00_model_states.pt") == "global_stepN/"
    assert [lookalike(n) for n in ("x.distcp", "e=1-step=2.ckpt", "m.safetensors", "m.pth", "notes.txt")] == [
        "*.distcp",
        "*.ckpt",
        "*.safetensors",
        "*.pth",
        None,
    ]
    assert lookalike("r/.hidden.ckpt") is None and lookalike("r/x.ckpt.part") is None
    torch = layout_for("torch")
    listed = Snapshot(
        {f.rel: f for f in files("a/final.pt", "a/best.pt", "a/step_10.pt")},
        lookalikes={"*.ckpt": "b/epoch=0-step=2.ckpt", "checkpoint-N/": "c/checkpoint-5/model.safetensors"},
    )
    warnings = naming_warnings(listed, torch)
    assert [(w.kind, w.pattern, w.path) for w in warnings] == [
        ("no_step", "*.pt", "a/best.pt"),
        ("not_selected", "*.ckpt", "b/epoch=0-step=2.ckpt"),
        ("not_selected", "checkpoint-N/", "c/checkpoint-5/model.safetensors"),
    ]
    assert 'layout = "lightning" would select it' in warnings[1].message
    assert "prune.step_pattern" in warnings[0].message
    lightning = layout_for("lightning")  # last.ckpt is an alias, not a checkpoint without a step
    assert naming_warnings(Snapshot({f.rel: f for f in files("r/last.ckpt", "r/epoch=0-step=2.ckpt")}), lightning) == []


def test_the_scan_records_the_first_lookalike_per_pattern(tmp_path: Path) -> None:
    """Files the layout does not select are never listed as checkpoints; one that looks like one is
    remembered, the first per pattern."""
    for rel in ("run/step_1.pt", "run/epoch=0-step=2.ckpt", "run/notes.txt", "run/checkpoint-5/model.safetensors"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    snap = snapshot_tree(tmp_path, ("*.pt",), layout=layout_for("torch"))
    assert sorted(snap.files) == ["run/step_1.pt"]
    assert snap.lookalikes == {
        "*.ckpt": "run/epoch=0-step=2.ckpt",
        "checkpoint-N/": "run/checkpoint-5/model.safetensors",
    }


def test_a_pattern_that_selects_a_file_beside_the_unit_folders_is_warned(tmp_path: Path) -> None:
    """Megatron's tracker named in `patterns` of a custom folder layout is a file, never a unit folder: no
    rule would ever mirror it, and the warning names the layout that does."""
    layout = layout_for("custom", ("iter_*", "latest_checkpointed_iteration.txt"), r"iter_(\d+)", "folder")
    (tmp_path / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    [warning] = naming_warnings(snapshot_tree(tmp_path, layout.patterns, layout=layout), layout)
    assert warning.path == "latest_checkpointed_iteration.txt" and 'layout = "megatron"' in warning.message


def test_a_folder_is_quiet_only_when_its_whole_listing_stayed_the_same() -> None:
    """Renamed into place or written, a new file, a changed one or one gone starts the wait again; a folder
    with no evidence of its end waits unit_seconds."""
    clock = [100.0]
    settle = SettleTracker(1.0, lambda: 1e9, lambda: clock[0], unit_seconds=5.0)
    layout = layout_for("hf_model")
    one = unit_of("hf_model", "step_1/model-00001-of-00002.safetensors")
    two = unit_of("hf_model", "step_1/model-00001-of-00002.safetensors", "step_1/model-00002-of-00002.safetensors")
    assert not settle.quiet(one, False)
    clock[0] += 1.5
    assert settle.quiet(one, False) and not settle.quiet(one, True)
    assert not settle.quiet(two, False)  # the file list changed: the wait starts again
    clock[0] += 1.5
    assert settle.quiet(two, False)
    assert "no index yet" in completeness(one, layout, settle.quiet_at(clock[0])).why
