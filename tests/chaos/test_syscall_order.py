"""The durability order, seen from the kernel's side: strace a real `mirrord sync` and `mirrord prune`.

For every published file and every manifest snapshot or journal: data written only to NAME.part ->
fsync of that file -> rename onto NAME -> fsync of the directory. Copies are committed in groups: one
fsync of a directory after all the group's renames in it, then one journal record for the group; a
copy is never recorded before the fsync of its directory returned. Created directories are fsynced
into their parent before anything is published in them; the journal is only appended to; a prune
deletes a recorded file only after a durable journal record of its removal; `copy.committed` is logged
only once the file and its journal record are durable. And the checks themselves are shown to fail on
deliberately broken copiers and manifests.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from mirrord.store.manifest import Manifest
from tests.chaos.harness import Checkpoints, Report, World, Zygote, step_name, write_config
from tests.chaos.syscalls import (
    durable_journal_records,
    order_violations,
    parse,
    recorded_before_dir_fsync,
    run_traced,
    trace_args,
)
from tests.support.cli import mirrord_argv

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def _populate(world: World, checkpoints: Checkpoints, rng: random.Random) -> None:
    for run in ("run-a", "run b"):
        for step in (1, 2, 3):
            world.install(f"{run}/{step_name(step)}", checkpoints.pick(rng))
    world.install(step_name(9), checkpoints.pick(rng))


def _second_cycle(world: World, checkpoints: Checkpoints, rng: random.Random) -> None:
    """Work that exercises every path: a new run folder, a replaced file, a stale temp file."""
    world.install(f"run-a/{step_name(2)}", checkpoints.pick(rng))  # rename over an existing copy
    world.install(f"run-c/{step_name(4)}", checkpoints.pick(rng))  # a directory to create
    world.install(f"run-a/{step_name(5)}", checkpoints.pick(rng))
    stale = world.mirror / "run-a" / (step_name(5) + ".part")
    stale.write_bytes(b"left behind by a dead process")


def test_sync_and_prune_follow_the_durability_order(
    world: World, checkpoints: Checkpoints, tmp_path: Path, report: Report
) -> None:
    """A real `mirrord sync` (fresh mirror, then a second pass with replacements) and a real prune."""
    tally = report.scenario("syscall order: sync + prune under strace")
    rng = random.Random(7)
    _populate(world, checkpoints, rng)
    configs = {
        "sync": write_config(tmp_path / "sync.toml", world),
        "prune": write_config(tmp_path / "prune.toml", world, prune={"enabled": True, "keep_last": 1}),
    }
    traces = tmp_path / "traces"
    traces.mkdir()
    totals: dict[str, int] = {}
    for label, setup, command in (
        ("first-sync", None, "sync"),
        ("second-sync", _second_cycle, "sync"),
        ("prune", None, "prune"),
    ):
        if setup is not None:
            setup(world, checkpoints, rng)
        recorded = set(Manifest.load(world.mirror).entries) if world.mirror.exists() else set()
        prefix = traces / label
        result = subprocess.run(
            ["strace", *trace_args(prefix), "--", *mirrord_argv(), command, "--config", str(configs[command])],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        violations, counts = order_violations(parse(prefix), world.mirror, recorded)
        tally.rounds += 1
        tally.check(violations, label)
        for key, n in counts.items():
            totals[key] = totals.get(key, 0) + n
    tally.notes.append(", ".join(f"{k} {v}" for k, v in totals.items()))
    tally.assert_clean()
    # Copies are recorded in groups: fewer journal appends than copies, at least one per command.
    assert totals["published"] >= 10 and totals["journal_appends"] >= 3 and totals["manifest_writes"] >= 3
    assert totals["dirs_created"] >= 3 and totals["unlinked"] >= 3 and totals["committed_logged"] >= 10


@pytest.mark.parametrize("broken", ["no_dir_fsync", "no_file_fsync", "rename_before_fsync"])
def test_the_order_check_catches_a_broken_copier(
    broken: str, world: World, checkpoints: Checkpoints, tmp_path: Path, zygote: Zygote, report: Report
) -> None:
    """The same check on a copier with one step of the protocol removed or misordered must fail."""
    tally = report.scenario(f"syscall order: broken copier ({broken}) is caught", expect_violations=True)
    _populate(world, checkpoints, random.Random(3))
    config = write_config(tmp_path / "mirrord.toml", world)
    prefix = tmp_path / "trace"
    status = run_traced(zygote, ["sync", "--config", config], tmp_path / "sync.log", trace_args(prefix), patch=broken)
    assert status == 0, (tmp_path / "sync.log").read_text()[-3000:]
    violations, counts = order_violations(parse(prefix), world.mirror)
    tally.rounds = 1
    tally.check(violations)
    tally.notes.append(f"{len(violations)} violation(s) found in {counts['published']} publications")
    assert violations, f"the order check did not notice the {broken} copier"
    shutil.rmtree(world.mirror)


@pytest.mark.parametrize("broken", ["journal_no_fsync", "late_removal"])
def test_the_order_check_catches_a_broken_manifest(
    broken: str, world: World, checkpoints: Checkpoints, tmp_path: Path, zygote: Zygote, report: Report
) -> None:
    """Journal records never fsynced (copies and removals count before they are durable), or removals
    recorded after the unlink: the checks of copy.committed and of every unlink must fail."""
    tally = report.scenario(f"syscall order: broken manifest ({broken}) is caught", expect_violations=True)
    _populate(world, checkpoints, random.Random(5))
    sync_cfg = write_config(tmp_path / "sync.toml", world)
    prune_cfg = write_config(tmp_path / "prune.toml", world, prune={"enabled": True, "keep_last": 1})
    found: list[str] = []
    for label, config, patch in (
        ("sync", sync_cfg, broken if broken == "journal_no_fsync" else None),
        ("prune", prune_cfg, broken),
    ):
        prefix = tmp_path / f"trace-{label}"
        recorded = set(Manifest.load(world.mirror).entries) if world.mirror.exists() else set()
        status = run_traced(
            zygote, [label, "--config", config], tmp_path / f"{label}.log", trace_args(prefix), patch=patch
        )
        assert status == 0, (tmp_path / f"{label}.log").read_text()[-3000:]
        violations, _ = order_violations(parse(prefix), world.mirror, recorded)
        found += violations
    tally.rounds = 1
    tally.check(found)
    kinds = {
        "journal_no_fsync": ("before a durable journal record of it", "unlinked before a durable journal"),
        "late_removal": ("unlinked before a durable journal",),
    }[broken]
    tally.notes.append(f"{len(found)} violation(s) found")
    for kind in kinds:
        assert any(kind in v for v in found), f"the order check did not notice the {broken} manifest ({kind})"


def test_the_order_check_catches_a_record_before_the_directory_fsync(
    world: World, checkpoints: Checkpoints, tmp_path: Path, zygote: Zygote, report: Report
) -> None:
    """Group commit with the journal record written before the directory fsync of the renames it
    vouches for (a power cut between the two could leave a recorded copy whose name was never kept):
    the check that every recorded copy's directory was fsynced first must fail, for each copy."""
    tally = report.scenario("syscall order: record before the directory fsync is caught", expect_violations=True)
    _populate(world, checkpoints, random.Random(9))
    config = write_config(tmp_path / "mirrord.toml", world)
    prefix = tmp_path / "trace"
    status = run_traced(
        zygote, ["sync", "--config", config], tmp_path / "sync.log", trace_args(prefix), patch="record_before_dir_fsync"
    )
    assert status == 0, (tmp_path / "sync.log").read_text()[-3000:]
    calls = parse(prefix)
    violations, counts = order_violations(calls, world.mirror)
    early = recorded_before_dir_fsync(calls, durable_journal_records(calls), str(world.mirror))
    tally.rounds = 1
    tally.check(violations)
    tally.notes.append(f"{len(early)} copies recorded early, of {counts['published']} published")
    # Every copy in a run folder is caught: nothing else fsyncs those folders. (A copy at the root may
    # be covered by chance: creating a run folder fsyncs the root.)
    in_folders = {str(world.mirror / rel) for rel in world.primary_files() if "/" in rel}
    assert in_folders and {v.split(": recorded")[0] for v in early} >= in_folders, early
    assert all(v in violations for v in early)
    shutil.rmtree(world.mirror)
