"""Folder units written by several nodes: a node's local share, the parts making the whole unit, and the
manifest that records them (mirrord.core.contributions, pure)."""

from __future__ import annotations

import warnings

import pytest

from mirrord.core.contributions import Contribution, Sharing, contribute, covered, local_part
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.plan import plan_unit_copies
from mirrord.core.units import Unit, completeness, group_units
from mirrord.formats.dcpmeta import storage_references
from mirrord.layouts import layout_for
from mirrord.store.manifest import decode_shared_snapshot, encode_snapshot

LAYOUT = layout_for("dcp")
MTIME = 1_700_000_000 * 10**9


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A real dcp.save whose .metadata lists two data files (the writer's two threads: __0_0, __0_1),
    as a save by two ranks lists __0_0 and __1_0."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    folder = tmp_path_factory.mktemp("dcp") / "step_3"
    state = {"a": torch.randn(16, 8), "b": torch.randn(8, 8), "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(folder), thread_count=2))
    found = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(found) == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    return found


def unit(saved: dict[str, bytes], *names: str, short: str = "") -> Unit:
    states = [FileState(f"run/step_3/{n}", len(saved[n]) - (n == short), MTIME) for n in names]
    return group_units(states, LAYOUT)["run/step_3"]


def entry(saved: dict[str, bytes], name: str, digest: str = "") -> ManifestEntry:
    return ManifestEntry(
        f"run/step_3/{name}", len(saved[name]), "blake3", digest or name, MTIME, 3, 1.0, validation="unchecked"
    )


def part(saved: dict[str, bytes], node: str, *names: str) -> Contribution:
    needs = storage_references(saved[".metadata"]) if ".metadata" in names else None
    return Contribution(node, {f"run/step_3/{n}": entry(saved, n) for n in names}, needs, 10.0)


def test_a_share_is_done_once_settled_and_each_file_is_one_the_metadata_lists(saved: dict[str, bytes]) -> None:
    """The node with rank 0's files judges them by its .metadata; the node without .metadata by their
    names; neither is whole by DCP's own rule, which stays as it was."""
    meta = saved[".metadata"]
    first = unit(saved, ".metadata", "__0_0.distcp")
    assert not completeness(first, LAYOUT, reads={"run/step_3/.metadata": meta}).complete
    assert local_part(first, lambda _f: True, meta).complete
    assert (
        "needs" in local_part(unit(saved, ".metadata", "__0_0.distcp", short="__0_0.distcp"), lambda _f: True, meta).why
    )
    assert "still being written" in local_part(first, lambda _f: False, meta).why
    assert "could not be read" in local_part(first, lambda _f: True, None).why
    assert local_part(first, lambda _f: True, b"\x80\x04\x95garbage").why.startswith(".metadata: ")
    second = unit(saved, "__0_1.distcp")
    assert local_part(second, lambda _f: True, None).complete
    stray = group_units(
        [FileState("run/step_3/__0_1.distcp", 5, MTIME), FileState("run/step_3/notes.txt", 5, MTIME)], LAYOUT
    )["run/step_3"]
    assert "notes.txt" in local_part(stray, lambda _f: True, None).why
    listed = group_units(
        [FileState("run/step_3/.metadata", len(meta), MTIME), FileState("run/step_3/extra.distcp", 5, MTIME)], LAYOUT
    )["run/step_3"]
    assert "not listed" in local_part(listed, lambda _f: True, meta).why


def test_the_unit_is_recorded_whole_only_by_the_part_that_completes_it(saved: dict[str, bytes]) -> None:
    """A first part is kept as a contribution (no entry); the second, whichever node's, records every file
    of both as entries in the same change and drops the contributions."""
    for first, second in (
        (part(saved, "a", ".metadata", "__0_0.distcp"), part(saved, "b", "__0_1.distcp")),
        (part(saved, "b", "__0_1.distcp"), part(saved, "a", ".metadata", "__0_0.distcp")),
    ):
        old = {"run/step_3/stale.distcp": entry(saved, "__0_1.distcp")}
        merged = contribute(old, {}, "run/step_3", first)
        assert not merged.verdict.complete and merged.puts == () and merged.removes == ()
        assert set(merged.contributions["run/step_3"]) == {first.node}
        done = contribute(old, merged.contributions, "run/step_3", second)
        assert done.verdict.complete, done.verdict.why
        assert {e.path for e in done.puts} == {f"run/step_3/{n}" for n in saved}
        assert done.removes == ("run/step_3/stale.distcp",)
        assert done.contributions == {}


def test_parts_that_do_not_cover_the_metadata_or_disagree_never_complete(saved: dict[str, bytes]) -> None:
    assert "no node has uploaded .metadata" in covered("run/step_3", {"b": part(saved, "b", "__0_1.distcp")}).why
    alone = covered("run/step_3", {"a": part(saved, "a", ".metadata", "__0_0.distcp")})
    assert "__0_1.distcp, which no node has uploaded" in alone.why
    clash = part(saved, "b", "__0_1.distcp", "__0_0.distcp")
    clash = Contribution(
        "b", {**clash.files, "run/step_3/__0_0.distcp": entry(saved, "__0_0.distcp", "other")}, None, 1.0
    )
    assert "two nodes" in covered("run/step_3", {"a": part(saved, "a", ".metadata", "__0_0.distcp"), "b": clash}).why


def test_the_planner_uploads_a_done_share_once(saved: dict[str, bytes]) -> None:
    """A share that is done is one job marked `part`; once recorded as this node's contribution and on the
    mirror, it is in sync (no upload again); without sharing it waits as before."""
    states = [FileState(f"run/step_3/{n}", len(saved[n]), MTIME) for n in ("__0_1.distcp",)]
    primary = Snapshot({s.rel: s for s in states})
    sharing = Sharing("b", {}, lambda u: local_part(u, lambda _f: True, None))
    judge = lambda u: completeness(u, LAYOUT)  # noqa: E731
    assert plan_unit_copies(primary, Snapshot(), {}, LAYOUT, judge).unsettled == ("run/step_3",)
    jobs = plan_unit_copies(primary, Snapshot(), {}, LAYOUT, judge, sharing=sharing).jobs
    assert [(j.rel, j.part, j.members) for j in jobs] == [("run/step_3", True, ("run/step_3/__0_1.distcp",))]
    recorded = Sharing("b", {"run/step_3": {"b": part(saved, "b", "__0_1.distcp")}}, sharing.part_done)
    mirror = Snapshot({s.rel: FileState(s.rel, s.size, MTIME + 5) for s in states})
    plan = plan_unit_copies(primary, mirror, {}, LAYOUT, judge, sharing=recorded)
    assert plan.jobs == () and plan.in_sync == 1
    gone = plan_unit_copies(primary, Snapshot(), {}, LAYOUT, judge, sharing=recorded)  # retention took the object
    assert [j.part for j in gone.jobs] == [True]


def test_contributions_survive_the_manifest_object_and_old_manifests_have_none(saved: dict[str, bytes]) -> None:
    entries = {"run/step_3/.metadata": entry(saved, ".metadata")}
    parts = {"run/step_3": {"a": part(saved, "a", ".metadata", "__0_0.distcp"), "b": part(saved, "b", "__0_1.distcp")}}
    data = encode_snapshot(entries, 0, parts)
    back, generation, contributions = decode_shared_snapshot(data, "manifest")
    assert back == entries and generation == 0 and contributions == parts
    assert decode_shared_snapshot(encode_snapshot(entries), "manifest")[2] == {}


def test_a_part_whose_objects_are_gone_is_dropped_and_a_part_already_recorded_changes_nothing(
    saved: dict[str, bytes],
) -> None:
    """Another node's part whose files are no longer stored with their sizes (retention deleted a stale
    part, the folder was saved again) never completes a unit: it is dropped, and that node uploads again.
    A part whose bytes the entries already record (another node completed the unit) records nothing."""
    stale = {"run/step_3": {"b": part(saved, "b", "__0_1.distcp")}}
    first = part(saved, "a", ".metadata", "__0_0.distcp")
    gone = {f"run/step_3/{n}": len(saved[n]) for n in (".metadata", "__0_0.distcp")}
    merged = contribute({}, stale, "run/step_3", first, gone)
    assert not merged.verdict.complete and set(merged.contributions["run/step_3"]) == {"a"}
    there = {**gone, "run/step_3/__0_1.distcp": len(saved["__0_1.distcp"])}
    assert contribute({}, stale, "run/step_3", first, there).verdict.complete
    whole = {e.path: e for e in contribute({}, stale, "run/step_3", first, there).puts}
    again = contribute(
        whole,
        {"run/step_3": {"b": part(saved, "b", "__0_1.distcp")}},
        "run/step_3",
        part(saved, "b", "__0_1.distcp"),
        there,
    )
    assert again.verdict.complete and again.puts == () and again.removes == () and again.contributions == {}
