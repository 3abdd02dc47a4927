"""Retention planning: a pure function of both listings, the manifest, the in-flight set, now and the policy.

The property tests generate random histories (steps on either or both sides, recorded or not, sizes
that do or do not match, changed sources, recent / zero / future mtimes, in-flight copies, orphan
temp files, files without a step) and check the plan against an independent oracle.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from hypothesis import given, settings
from hypothesis import strategies as st

from mirrord.config import PruneConfig
from mirrord.core.branches import branches, run_rollbacks
from mirrord.core.model import PENDING, PREVIOUS, FileState, ManifestEntry, Snapshot, step_of, version_key
from mirrord.core.retention import (
    KeepEvery,
    KeepLast,
    PrunePlan,
    PruneRequest,
    mirror_unmounted,
    plan_prune,
    preserved,
    retired_versions,
)
from mirrord.layouts import layout_for

NOW = 1_700_000_000.0
NS = 1_000_000_000
STEP_RE = re.compile(r"step_(\d+)")
ROOTS = {"primary": PurePath("/data/ckpt"), "mirror": PurePath("/mnt/mirror/ckpt")}
MTIMES = {
    "old": int((NOW - 86_400) * NS),
    "recent": int((NOW - 10) * NS),
    "zero": 0,
    "future": int((NOW + 3_600) * NS),
    "near_future": int((NOW + 30) * NS),
}


def rel_of(run: str, name: str) -> str:
    return f"{run}/{name}" if run else name


@dataclass
class History:
    policy: PruneConfig
    primary: dict[str, FileState] = field(default_factory=dict)
    mirror: dict[str, FileState] = field(default_factory=dict)
    partials: dict[str, FileState] = field(default_factory=dict)
    manifest: dict[str, ManifestEntry] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)

    def plan(self, errors: tuple[str, ...] = ()) -> PrunePlan:
        return plan_prune(
            Snapshot(dict(self.primary), errors=errors),
            Snapshot(dict(self.mirror), dict(self.partials)),
            dict(self.manifest),
            PruneRequest(self.policy, STEP_RE, NOW, frozenset(self.in_flight), ROOTS),
        )


def _often(value: object, *others: object) -> st.SearchStrategy[object]:
    """`value` most of the time, one of `others` sometimes."""
    return st.sampled_from([value] * 5 + list(others))


@st.composite
def histories(draw: st.DrawFn, guards_quiet: bool = False, steady: bool = False) -> History:
    """A random history. guards_quiet: every file old and nothing in flight. steady: also every step
    on both sides, recorded, matching and current (the state after a completed sync)."""
    quiet = guards_quiet or steady
    policy = PruneConfig(
        keep_last=draw(st.integers(1, 5)),
        keep_every=draw(st.one_of(st.none(), st.integers(2, 7))),
        primary=True if steady else draw(st.booleans()),
        min_age_seconds=300,
        future_skew_seconds=60,
    )
    h = History(policy)
    runs = draw(st.lists(st.sampled_from(["", "a", "b/c"]), min_size=1, max_size=2, unique=True))
    kinds = list(MTIMES)
    for run in runs:
        for step in draw(st.lists(st.integers(0, 30), max_size=14, unique=True)):
            rel = rel_of(run, f"step_{step:04d}.pt")
            where = "both" if steady else draw(_often("both", "primary", "mirror"))
            recorded = "ok" if steady else draw(_often("ok", "missing", "bad_size"))
            changed = False if steady else draw(_often(False, True))
            pkind = "old" if quiet else draw(_often("old", *kinds))
            mkind = pkind if quiet else draw(_often(pkind, *kinds))
            size = 100 + step
            pm = MTIMES[pkind] + (step * NS if pkind == "old" else 0)
            mm = pm if mkind == pkind else MTIMES[mkind]
            if where in ("both", "primary"):
                h.primary[rel] = FileState(rel, size + (5 if changed else 0), pm + (NS if changed else 0), ino=step)
            if where in ("both", "mirror"):
                h.mirror[rel] = FileState(rel, size, mm, ino=1000 + step)
                if recorded != "missing":
                    # recorded just after the save, as the same clock says (a record made before its own
                    # save reads as a stepped clock, mirrord.core.branches; test_record covers that case)
                    at = min(NOW, pm / NS + 1) if pm > 0 else NOW - 100
                    h.manifest[rel] = ManifestEntry(
                        rel, size + (1 if recorded == "bad_size" else 0), "blake3", "00", pm, step, at
                    )
            if not quiet and draw(_often(False, True)):
                h.in_flight.add(rel)
            if not steady and draw(_often(False, True)):  # a second file of the step, not yet mirrored
                other = rel_of(run, f"optim_step_{step:04d}.pt")
                h.primary[other] = FileState(other, 7, pm, ino=2000 + step)
        if not steady and draw(st.booleans()):
            cfg = rel_of(run, "config.pt")
            h.primary[cfg] = FileState(cfg, 3, MTIMES["old"], ino=3000)
            h.mirror[cfg] = FileState(cfg, 3, MTIMES["old"], ino=3001)
        if not steady and draw(st.booleans()):
            step = draw(st.integers(0, 30))
            part = rel_of(run, f"step_{step:04d}.pt.part")
            h.partials[part] = FileState(part, 50, MTIMES["old" if quiet else draw(_often("old", *kinds))], ino=4000)
            if not quiet and draw(st.booleans()):
                h.in_flight.add(part.removesuffix(".part"))
    return h


# -- an oracle written from the words, independent of the planner -----------------------------


def by_run_step(files: dict[str, FileState]) -> dict[str, dict[int, list[FileState]]]:
    out: dict[str, dict[int, list[FileState]]] = defaultdict(lambda: defaultdict(list))
    for s in files.values():
        step = step_of(s.rel, STEP_RE)
        if step is not None:
            out[s.run][step].append(s)
    return out


def unconfirmed_steps(h: History) -> dict[str, set[int]]:
    """Per run: steps with a mirror file whose size or mtime no longer matches its record."""
    out: dict[str, set[int]] = defaultdict(set)
    for run, steps in by_run_step(h.mirror).items():
        for step, files in steps.items():
            if any(
                (e := h.manifest.get(m.rel)) is not None
                and (e.size != m.size or abs(m.mtime_ns - e.source_mtime_ns) > 2 * NS)
                for m in files
            ):
                out[run].add(step)
    return out


def verified_steps(h: History) -> dict[str, set[int]]:
    """Per run: steps whose every file is on the mirror as recorded (size, mtime), and current."""
    prim, mirr = by_run_step(h.primary), by_run_step(h.mirror)
    unconfirmed = unconfirmed_steps(h)
    out: dict[str, set[int]] = defaultdict(set)
    for run in set(prim) | set(mirr):
        for step in set(prim[run]) | set(mirr[run]):
            on_mirror = mirr[run][step]
            if not on_mirror or step in unconfirmed[run]:
                continue
            ok = all(h.manifest.get(m.rel) is not None for m in on_mirror)
            for p in prim[run][step]:
                e, m = h.manifest.get(p.rel), h.mirror.get(p.rel)
                ok = ok and e is not None and m is not None and e.size == p.size == m.size
                ok = ok and e.source_mtime_ns == p.mtime_ns and abs(m.mtime_ns - p.mtime_ns) <= 2 * NS
            if ok:
                out[run].add(step)
    return out


def all_steps(h: History) -> dict[str, set[int]]:
    out: dict[str, set[int]] = defaultdict(set)
    for files in (h.primary, h.mirror):
        for run, steps in by_run_step(files).items():
            out[run].update(steps)
    return out


def written(h: History) -> dict[str, dict[int, int]]:
    """Per run, when each step was written: the primary's mtime, else the source mtime the manifest
    recorded (never the mirror file's own); an mtime beyond the skew allowance, or none, is unknown (0)."""
    prim, mirr = by_run_step(h.primary), by_run_step(h.mirror)
    lie = (NOW + h.policy.future_skew_seconds) * NS
    out = {}
    for run, steps in all_steps(h).items():
        mtimes = {}
        for s in steps:
            if prim[run][s]:
                m = max(f.mtime_ns for f in prim[run][s])
            else:
                m = max((h.manifest[f.rel].source_mtime_ns for f in mirr[run][s] if f.rel in h.manifest), default=0)
            mtimes[s] = 0 if m > lie else m
        out[run] = mtimes
    return out


def order(h: History) -> dict[str, list[int]]:
    """Per run, steps oldest first: by branch (mirrord.core.branches), then step. Without a rollback
    this is plain step order."""
    return {run: sorted(mtimes, key=branches(mtimes).key) for run, mtimes in written(h).items()}


def branch_tips(h: History) -> dict[str, set[int]]:
    """Per run, the newest step of each abandoned branch: its newest verified one, else its newest."""
    verified = verified_steps(h)
    out: dict[str, set[int]] = defaultdict(set)
    for run, mtimes in written(h).items():
        b = branches(mtimes)
        for branch in range(b.top):
            steps = [s for s in order(h)[run] if b.of.get(s, b.top) == branch]
            good = [s for s in steps if s in verified[run]]
            if steps:
                out[run].add((good or steps)[-1])
    return out


def paused_runs(h: History) -> set[str]:
    """Runs whose newest verified step has no file on the primary."""
    prim = by_run_step(h.primary)
    return {run for run, top in top_verified(h).items() if top and not prim[run][top[-1]]}


def top_verified(h: History) -> dict[str, list[int]]:
    """Per run, the keep_last newest verified steps, oldest first."""
    verified = verified_steps(h)
    return {run: [s for s in steps if s in verified[run]][-h.policy.keep_last :] for run, steps in order(h).items()}


def kept_steps(h: History) -> dict[str, set[int]]:
    steps = all_steps(h)
    kept: dict[str, set[int]] = {}
    for run, top in top_verified(h).items():
        every = h.policy.keep_every
        kept[run] = set(top) | ({s for s in steps[run] if s % every == 0} if every else set())
        kept[run] |= branch_tips(h)[run]
    return kept


def deletable_steps(h: History) -> dict[str, set[int]]:
    """Below the keep_last newest steps present, kept by no policy, and those keep_last all verified."""
    verified, kept, unconfirmed, paused = verified_steps(h), kept_steps(h), unconfirmed_steps(h), paused_runs(h)
    out = {}
    for run, steps in order(h).items():
        window = steps[-h.policy.keep_last :]
        retired = steps[: max(0, len(steps) - h.policy.keep_last)]
        out[run] = {
            s
            for s in retired
            if (s not in kept[run] or primary_tip(h, run, s))
            and s not in unconfirmed[run]
            and run not in paused
            and all(w in verified[run] for w in window)
        }
    return out


def primary_tip(h: History, run: str, step: int) -> bool:
    """A verified abandoned branch tip that only keep_branch_tips keeps: kept on the mirror, not the primary."""
    every = h.policy.keep_every
    return (
        step in branch_tips(h)[run]
        and step in verified_steps(h)[run]
        and step not in top_verified(h)[run]
        and not (every and step % every == 0)
    )


def newest_files(h: History) -> set[str]:
    out = set()
    for run, steps in top_verified(h).items():
        if steps:
            top = steps[-1]
            out |= {
                s.rel
                for f in (h.primary, h.mirror)
                for s in f.values()
                if s.run == run and step_of(s.rel, STEP_RE) == top
            }
    return out


# -- properties ---------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=150, deadline=None)


@PROPERTY
@given(histories())
def test_never_plans_deleting_a_recent_zero_future_in_flight_or_newest_file(h: History) -> None:
    """Every planned deletion is an old, regular file with a known mtime, not in flight, not the newest."""
    plan = h.plan()
    newest = newest_files(h)
    for d in plan.deletions:
        s = d.state
        assert s.mtime_ns > 0, d
        assert s.mtime_ns <= (NOW - h.policy.min_age_seconds) * NS, d
        assert s.rel not in h.in_flight and s.rel.removesuffix(".part") not in h.in_flight, d
        assert s.rel not in newest, d


@PROPERTY
@given(histories())
def test_never_plans_deleting_a_kept_or_unverified_newer_step(h: History) -> None:
    """Deleted steps are below the keep_last newest steps present, kept by no policy, and those newest
    steps of their run are all verified (a torn or unfinished newest step keeps the older ones)."""
    plan = h.plan()
    kept, verified, deletable = kept_steps(h), verified_steps(h), deletable_steps(h)
    for d in plan.deletions:
        if d.kind == "orphan_part":
            continue
        run = d.state.run
        assert d.step is not None
        assert d.step not in kept[run] or (d.volume == "primary" and primary_tip(h, run, d.step)), d
        assert verified[run], "a run with no verified step has no candidates"
        assert d.step in deletable[run], d
        assert all(s in verified[run] for s in order(h)[run][-h.policy.keep_last :]), d


@PROPERTY
@given(histories())
def test_a_primary_file_goes_only_below_a_verified_window_and_the_newest_verified_step(h: History) -> None:
    """Mirrored or not, a primary step is deleted only when the keep_last newest steps of its run are all
    verified, and it is older by branch than the run's newest verified step (issue 32 item 4)."""
    verified, steps = verified_steps(h), order(h)
    for d in h.plan().deletions:
        if d.volume == "primary":
            run = d.state.run
            assert d.step is not None and all(w in verified[run] for w in steps[run][-h.policy.keep_last :]), d
            assert steps[run].index(d.step) < steps[run].index(top_verified(h)[run][-1]), d


@PROPERTY
@given(histories())
def test_kept_set_has_exactly_min_keep_last_verified_steps(h: History) -> None:
    """Per run, the keep_last set is the min(keep_last, verified) highest verified steps."""
    plan = h.plan()
    verified = verified_steps(h)
    by_run: dict[str, set[int]] = defaultdict(set)
    for k in plan.kept:
        if k.why == "keep_last":
            assert k.step is not None
            by_run[k.rel.rpartition("/")[0]].add(k.step)
    for run in all_steps(h):
        expected = set(top_verified(h)[run])
        assert len(by_run[run]) == min(h.policy.keep_last, len(verified[run]))
        assert by_run[run] == expected


@PROPERTY
@given(histories())
def test_keep_every_milestones_are_never_deleted(h: History) -> None:
    every = h.policy.keep_every
    for d in h.plan().deletions:
        assert every is None or d.step is None or d.step % every != 0, d


@PROPERTY
@given(histories())
def test_every_file_gets_exactly_one_decision(h: History) -> None:
    """Each mirror file is deleted, kept or skipped - exactly one; the primary too when it is pruned,
    and with prune.primary = false the primary is never a deletion candidate."""
    plan = h.plan()
    decisions: dict[tuple[str, str], int] = defaultdict(int)
    for d in plan.deletions:
        decisions[d.volume, d.rel] += 1
    for k in plan.kept:
        decisions[k.volume, k.rel] += 1
    for s in plan.skipped:
        decisions[s.volume, s.rel] += 1
    for rel in list(h.mirror) + list(h.partials):
        assert decisions.pop(("mirror", rel)) == 1, rel
    for rel in h.primary:
        n = decisions.pop(("primary", rel), 0)
        assert n == 1 if h.policy.primary else n <= 1, rel
    assert not decisions
    if not h.policy.primary:
        assert not [d for d in plan.deletions if d.volume == "primary"]
        assert not [s for s in plan.skipped if s.volume == "primary"]


@PROPERTY
@given(histories(guards_quiet=True))
def test_both_sides_lose_the_same_steps(h: History) -> None:
    """With primary pruning on and no guard objecting, a verified step present on both sides goes from
    both or neither; an unverified mirror copy may go alone, its primary file never without it."""
    h.policy = h.policy.model_copy(update={"primary": True})
    plan = h.plan()
    gone: dict[str, set[tuple[str, int | None]]] = defaultdict(set)
    for d in plan.deletions:
        if d.kind == "step":
            gone[d.volume].add((d.state.run, d.step))
    verified = {(run, s) for run, steps in verified_steps(h).items() for s in steps}
    tips = {(run, s) for run, steps in branch_tips(h).items() for s in steps}  # kept on the mirror alone
    common = {(s.run, step_of(s.rel, STEP_RE)) for s in h.primary.values() if s.rel in h.mirror} & verified - tips
    assert gone["primary"] & common == gone["mirror"] & common
    assert (
        gone["primary"]
        <= gone["mirror"]
        | {(s.run, step_of(s.rel, STEP_RE)) for s in h.primary.values() if s.rel not in h.mirror}
        | verified
    )


@PROPERTY
@given(histories(steady=True))
def test_after_a_full_sync_both_sides_end_with_the_same_kept_steps(h: History) -> None:
    """Steady state: what remains on each side is exactly the kept set, the same on both."""
    plan = h.plan()
    deleted = {(d.volume, d.rel) for d in plan.deletions}
    assert not plan.skipped
    remaining = {
        vol: {(s.run, step_of(s.rel, STEP_RE)) for s in files.values() if (vol, s.rel) not in deleted}
        for vol, files in (("primary", h.primary), ("mirror", h.mirror))
    }
    kept = {(run, step) for run, steps in kept_steps(h).items() for step in steps}
    assert remaining["primary"] == remaining["mirror"] == kept


@PROPERTY
@given(histories(), st.sampled_from(["primary", "mirror"]))
def test_a_partial_listing_deletes_nothing(h: History, side: str) -> None:
    """A listing error on either side refuses the whole plan."""
    primary_errors = ("/data/ckpt/x: cannot list: Input/output error",) if side == "primary" else ()
    plan = plan_prune(
        Snapshot(dict(h.primary), errors=primary_errors),
        Snapshot(dict(h.mirror), dict(h.partials), errors=() if primary_errors else ("/m: cannot list",)),
        dict(h.manifest),
        PruneRequest(h.policy, STEP_RE, NOW, frozenset(h.in_flight), ROOTS),
    )
    assert plan.deletions == ()
    assert [r for r, _ in plan.refused] == ["partial_view"]


@settings(max_examples=50, deadline=None)
@given(histories())
def test_planning_is_pure(h: History) -> None:
    """The same inputs give the same plan, and the inputs are not modified."""
    before = (dict(h.primary), dict(h.mirror), dict(h.manifest), set(h.in_flight))
    assert h.plan() == h.plan()
    assert (h.primary, h.mirror, h.manifest, h.in_flight) == before


# -- examples -----------------------------------------------------------------------------------------


def synced(steps: range, run: str = "run", mtime_ns: int = MTIMES["old"]) -> History:
    h = History(PruneConfig(keep_last=3, primary=True))
    for step in steps:
        rel = rel_of(run, f"step_{step:04d}.pt")
        h.primary[rel] = FileState(rel, 100, mtime_ns + step, ino=step)
        h.mirror[rel] = FileState(rel, 100, mtime_ns + step, ino=100 + step)
        h.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", mtime_ns + step, step, NOW)
    return h


def test_kept_files_read_in_path_then_volume_order() -> None:
    """plan.kept (made into records only when read) lists each kept file once, by path then volume."""
    h = synced(range(1, 6), run="b")
    h.primary.update(synced(range(1, 3), run="a").primary)
    kept = h.plan().kept
    listed = [(k.rel, k.volume) for k in kept]
    assert len(kept) == len(listed) == 3 * 2 + 2 and listed == sorted(listed)
    assert kept[0].rel == "a/step_0001.pt" and tuple(kept) == tuple(h.plan().kept)


def test_keep_last_three_of_ten_deletes_steps_one_to_seven_on_both_sides() -> None:
    plan = synced(range(1, 11)).plan()
    assert sorted((d.volume, d.step) for d in plan.deletions) == sorted(
        (vol, s) for vol in ("primary", "mirror") for s in range(1, 8)
    )
    assert {(k.step, k.why) for k in plan.kept} == {(8, "keep_last"), (9, "keep_last"), (10, "keep_last")}
    assert all(d.rel in synced(range(1, 11)).manifest for d in plan.deletions)  # the executor drops each record
    assert plan.retired("run", 7) and not plan.retired("run", 8)


def test_deletions_are_ordered_oldest_first_primary_before_mirror() -> None:
    """A primary file may only go while its verified mirror copy is still there."""
    plan = synced(range(1, 6)).plan()
    assert [(d.step, d.volume) for d in plan.deletions] == [
        (1, "primary"),
        (1, "mirror"),
        (2, "primary"),
        (2, "mirror"),
    ]


def test_steps_newer_than_the_kept_set_and_unverified_gaps_are_kept() -> None:
    """Not yet mirrored (newer) and unverified (inside the window) are kept, with their reason; while
    they are not verified, every older step is kept too (it is still the fallback)."""
    h = synced(range(1, 9))
    del h.manifest["run/step_0007.pt"]  # 7 is on the mirror but not recorded
    h.primary["run/step_0009.pt"] = FileState("run/step_0009.pt", 100, MTIMES["old"] + 9, ino=9)  # not copied yet
    plan = h.plan()
    why = {(k.volume, k.step): k.why for k in plan.kept}
    assert why["primary", 9] == "newer_than_kept"
    assert why["mirror", 7] == why["primary", 7] == "unverified"
    assert {s for (_, s), w in why.items() if w == "keep_last"} == {5, 6, 8}
    assert {s for (_, s), w in why.items() if w == "newer_unverified"} == {1, 2, 3, 4}
    assert plan.deletions == ()
    assert plan.retired("run", 4) and not plan.retired("run", 7)  # the window is the 3 newest present
    assert not plan.retired("run", 6)  # kept by keep_last while 7 and 9 are not verified
    h.manifest["run/step_0007.pt"] = ManifestEntry("run/step_0007.pt", 100, "blake3", "00", MTIMES["old"] + 7, 7, NOW)
    h.mirror["run/step_0009.pt"] = FileState("run/step_0009.pt", 100, MTIMES["old"] + 9, ino=109)
    h.manifest["run/step_0009.pt"] = ManifestEntry("run/step_0009.pt", 100, "blake3", "00", MTIMES["old"] + 9, 9, NOW)
    assert {d.step for d in h.plan().deletions} == {1, 2, 3, 4, 5, 6}


def test_a_torn_newest_step_keeps_every_older_one() -> None:
    """The issue's small repro: a good step 1 and a torn step 2 (never recorded), keep_last = 1."""
    h = synced(range(1, 2))
    h.policy = PruneConfig(keep_last=1, primary=True)
    h.primary["run/step_0002.pt"] = FileState("run/step_0002.pt", 50, MTIMES["old"] + 2, ino=2)
    plan = h.plan()
    assert plan.deletions == ()
    assert {(k.volume, k.step, k.why) for k in plan.kept} >= {("mirror", 1, "keep_last"), ("primary", 1, "keep_last")}
    assert not plan.retired("run", 2)


def test_a_file_that_failed_its_validator_does_not_retire_the_step_before_it() -> None:
    """Step 2 is known torn (its validator failed): it does not count as present, so step 1 is in the
    window and worth copying, while step 2, unverified, still keeps it from being deleted."""
    h = History(PruneConfig(keep_last=1, primary=True))
    for step, size in ((1, 100), (2, 50)):
        rel = f"run/step_{step:04d}.pt"
        h.primary[rel] = FileState(rel, size, MTIMES["old"] + step, ino=step)
    plan = plan_prune(
        Snapshot(dict(h.primary)),
        Snapshot(),
        {},
        PruneRequest(h.policy, STEP_RE, NOW, roots=ROOTS, invalid=frozenset({"run/step_0002.pt"})),
    )
    assert not plan.retired("run", 1) and not plan.retired("run", 2)
    assert plan.deletions == ()
    assert h.plan().retired("run", 1)  # not known to be torn: the newest step present wins the window


def test_a_primary_step_outside_a_verified_window_goes_whether_or_not_it_was_mirrored() -> None:
    """prune.primary bounds the primary: step 1 was rewritten after it was mirrored and step 0 never was;
    both are below a verified window, so both go (issue 32 item 4)."""
    h = synced(range(1, 6))
    h.primary["run/step_0001.pt"] = FileState("run/step_0001.pt", 101, MTIMES["old"] + 1, ino=1)  # rewritten
    h.primary["run/step_0000.pt"] = FileState("run/step_0000.pt", 100, MTIMES["old"], ino=99)  # never mirrored
    plan = h.plan()
    assert not plan.skipped
    assert {(d.volume, d.step) for d in plan.deletions} == {
        ("primary", 0),
        ("mirror", 1),
        ("primary", 1),
        ("primary", 2),
        ("mirror", 2),
    }


def test_a_rollback_is_a_newer_branch_than_the_abandoned_steps() -> None:
    """Steps 1-6 written, then the trainer went back and wrote 3 and 4 again (newer mtimes): 3 and 4
    are the newest, never retired; 5 is retired and goes once 3 and 4 are verified; 6, the abandoned
    branch's tip, is kept (prune.keep_branch_tips)."""
    h = synced(range(1, 7))
    h.policy = PruneConfig(keep_last=2, primary=False)
    for step in (3, 4):
        rel = f"run/step_{step:04d}.pt"
        h.primary[rel] = FileState(rel, 100, MTIMES["old"] + 100 + step, ino=50 + step)  # not mirrored yet
    plan = h.plan()
    assert plan.rollbacks == {"run": ((6, 3),)}
    assert not plan.retired("run", 3, MTIMES["old"] + 103) and not plan.retired("run", 4, MTIMES["old"] + 104)
    assert plan.retired("run", 1) and plan.retired("run", 2)
    assert not plan.retired("run", 5) and not plan.retired("run", 6)  # the fallback until 3 and 4 verify
    assert plan.deletions == ()  # 3 and 4 (the new branch) are not verified yet
    for step in (3, 4):
        rel = f"run/step_{step:04d}.pt"
        h.mirror[rel] = FileState(rel, 100, MTIMES["old"] + 100 + step, ino=150 + step)
        h.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", MTIMES["old"] + 100 + step, step, NOW)
    after = h.plan()
    assert {d.step for d in after.deletions} == {1, 2, 5}
    assert after.branch_tips == {"run": (6,)} and {k.why for k in after.kept if k.step == 6} == {"branch_tip"}
    assert not plan.retired("run", 2, MTIMES["old"] + 500)  # newer than anything seen: a new file


def test_files_without_a_step_are_never_pruned() -> None:
    h = synced(range(1, 6))
    h.mirror["run/final.pt"] = FileState("run/final.pt", 10, MTIMES["old"])
    plan = h.plan()
    assert ("mirror", "run/final.pt", "no_step") in {(k.volume, k.rel, k.why) for k in plan.kept}


def test_a_run_with_nothing_verified_has_no_candidates() -> None:
    h = synced(range(1, 6))
    h.manifest.clear()
    h.mirror["x.pt"] = FileState("x.pt", 1, 1)  # the mirror is not empty: this is not "unmounted"
    plan = h.plan()
    assert plan.deletions == () and plan.refused == ()
    assert {k.why for k in plan.kept if k.step is not None} == {"newer_than_kept", "newer_unverified"}


def test_runs_are_pruned_independently() -> None:
    h = synced(range(1, 6), run="a")
    other = synced(range(10, 12), run="b")
    for name in ("primary", "mirror", "manifest"):
        getattr(h, name).update(getattr(other, name))
    plan = h.plan()
    assert {(d.state.run, d.step) for d in plan.deletions} == {("a", 1), ("a", 2)}
    assert set(plan.windows) == {"a"}  # run b has no more than keep_last steps: nothing retired


def test_guards_move_candidates_to_skipped_with_their_reason() -> None:
    h = synced(range(1, 8))
    h.primary["run/step_0001.pt"] = FileState("run/step_0001.pt", 100, 0, ino=1)
    h.mirror["run/step_0002.pt"] = FileState("run/step_0002.pt", 100, MTIMES["recent"], ino=102)
    h.in_flight.add("run/step_0003.pt")
    plan = h.plan()
    # Step 2's mirror copy no longer has its recorded mtime: unconfirmed, neither counted nor deleted, and
    # reported as vetoed by the guard that would veto it (issue 42 case 5).
    assert {(s.volume, s.step, s.reason) for s in plan.skipped} == {
        ("primary", 1, "zero_mtime"),
        ("mirror", 2, "recent_mtime"),
        ("primary", 3, "in_flight"),
        ("mirror", 3, "in_flight"),
    }
    assert {k.why for k in plan.kept if k.step == 2} == {"unconfirmed"}


def test_orphan_temp_files_are_candidates_under_the_same_guards() -> None:
    h = synced(range(1, 3))
    h.partials["run/step_0009.pt.part"] = FileState("run/step_0009.pt.part", 5, MTIMES["old"], ino=9)
    h.partials["run/step_0010.pt.part"] = FileState("run/step_0010.pt.part", 5, MTIMES["recent"], ino=10)
    h.partials["run/step_0011.pt.part"] = FileState("run/step_0011.pt.part", 5, MTIMES["old"], ino=11)
    h.in_flight.add("run/step_0011.pt")
    plan = h.plan()
    assert [(d.rel, d.kind) for d in plan.deletions] == [("run/step_0009.pt.part", "orphan_part")]
    assert {(s.rel, s.reason) for s in plan.skipped} == {
        ("run/step_0010.pt.part", "recent_mtime"),
        ("run/step_0011.pt.part", "in_flight"),
    }


def test_empty_mirror_with_a_manifest_is_refused() -> None:
    h = synced(range(1, 6))
    h.mirror.clear()
    plan = h.plan()
    assert plan.deletions == ()
    assert [r for r, _ in plan.refused] == ["mirror_unmounted"]


def test_mirror_unmounted_checks() -> None:
    entry = {"a.pt": ManifestEntry("a.pt", 1, "blake3", "00", 1, None, 0.0)}
    full = Snapshot({"a.pt": FileState("a.pt", 1, 1)})
    assert mirror_unmounted(Snapshot(), entry) is not None
    assert mirror_unmounted(full, entry) is None
    assert mirror_unmounted(Snapshot(), {}) is None  # a new, empty mirror is fine
    assert mirror_unmounted(full, entry, is_mount=False) is not None
    assert mirror_unmounted(full, entry, is_mount=True) is None


def test_retired_steps_are_below_the_window_and_kept_by_no_policy() -> None:
    """The copy planner can ask the plan whether a primary file is worth copying again."""
    h = synced(range(1, 11))
    h.policy = PruneConfig(keep_last=3, keep_every=5, primary=False)
    plan = h.plan()
    assert plan.retired("run", 1) and plan.retired("run", 7)
    assert not plan.retired("run", 5)  # a milestone
    assert not plan.retired("run", 8) and not plan.retired("run", 11)
    assert not plan.retired("run", None) and not plan.retired("other", 1)


def test_policies_keep_if_any_keeps() -> None:
    steps = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    verified = {0, 1, 2, 3, 4, 5, 6, 7, 8}
    assert KeepLast(2).preserve(steps, verified) == {7, 8}
    assert KeepEvery(5).preserve(steps, verified) == {0, 5, 10}
    assert preserved([KeepLast(2), KeepEvery(4)], steps, verified) == {
        7: "keep_last",
        8: "keep_last",
        0: "keep_every",
        4: "keep_every",
    }
    assert KeepLast(3).preserve(steps, set()) == frozenset()


# -- the primary's own rollbacks: the plan says what run_rollbacks says ---------------------------------


@st.composite
def written_runs(draw: st.DrawFn) -> tuple[Snapshot, Snapshot]:
    """Runs whose steps were written in any order (rollbacks), some files with an unknown (0), lying (past
    the skew) or nearly lying mtime, some steps on one side only, some with a second file."""
    primary: dict[str, FileState] = {}
    mirror: dict[str, FileState] = {}
    for run in draw(st.lists(st.sampled_from(["", "a", "b/c"]), min_size=1, max_size=3, unique=True)):
        steps = draw(st.permutations(draw(st.lists(st.integers(0, 20), max_size=10, unique=True))))
        for written, step in enumerate(steps):
            for name in ("step", "optim_step")[: draw(st.integers(1, 2))]:
                rel = rel_of(run, f"{name}_{step:04d}.pt")
                kind = draw(_often("written", *MTIMES))
                mtime = MTIMES["old"] + written * NS if kind == "written" else MTIMES[kind]
                where = draw(_often("both", "primary", "mirror"))
                if where != "mirror":
                    primary[rel] = FileState(rel, 100, mtime, ino=step)
                if where != "primary":
                    mirror[rel] = FileState(rel, 100, draw(_often(mtime, MTIMES["old"], 0)), ino=100 + step)
    return Snapshot(primary), Snapshot(mirror)


@PROPERTY
@given(written_runs())
def test_the_primary_rollbacks_of_a_plan_are_run_rollbacks_of_the_primary_listing(
    sides: tuple[Snapshot, Snapshot],
) -> None:
    """The daemon warns about rollbacks from the plan instead of grouping the tree again: the same runs and
    rollbacks as run_rollbacks reads from the primary alone (mirror-only steps and lying clocks included)."""
    primary, mirror = sides
    policy = PruneConfig(keep_last=2, future_skew_seconds=60)
    plan = plan_prune(primary, mirror, {}, PruneRequest(policy, STEP_RE, NOW))
    lie = (NOW + policy.future_skew_seconds) * 1e9
    assert plan.primary_rollbacks == run_rollbacks(primary.files.values(), STEP_RE, lie)


def test_a_rollback_on_the_primary_alone_is_in_the_plan() -> None:
    """Steps 1-4 written, then 2 again; the mirror still holds the abandoned 3 and 4 only (a step the primary
    lost is no part of the primary's order), and a file of step 4 stamped an hour ahead counts as unknown."""
    old = MTIMES["old"]
    primary = {
        rel_of("run", f"step_{s:04d}.pt"): FileState(rel_of("run", f"step_{s:04d}.pt"), 1, old + t * NS)
        for s, t in ((1, 1), (2, 5), (3, 3))
    }
    primary["run/optim_step_0003.pt"] = FileState("run/optim_step_0003.pt", 1, MTIMES["future"])
    mirror = {
        rel_of("run", f"step_{s:04d}.pt"): FileState(rel_of("run", f"step_{s:04d}.pt"), 1, old + s * NS) for s in (3, 4)
    }
    recorded = {rel: ManifestEntry(rel, 1, "blake3", "00", f.mtime_ns, None, NOW) for rel, f in mirror.items()}
    plan = plan_prune(
        Snapshot(primary), Snapshot(mirror), recorded, PruneRequest(PruneConfig(keep_last=2), STEP_RE, NOW)
    )
    assert plan.primary_rollbacks == {"run": ((3, 2),)}
    assert plan.rollbacks == {"run": ((4, 2),)}  # retention's order: the manifest's word for step 4


def test_a_folder_layout_leaves_the_primary_rollbacks_to_run_rollbacks() -> None:
    """Folder units group by unit, run_rollbacks by file: the plan does not pretend they agree."""
    layout = layout_for("hf")
    primary = Snapshot({"r/checkpoint-1/model.bin": FileState("r/checkpoint-1/model.bin", 1, MTIMES["old"])})
    plan = plan_prune(
        primary, Snapshot(), {}, PruneRequest(PruneConfig(), re.compile(layout.step_pattern), NOW, layout=layout)
    )
    assert plan.primary_rollbacks is None


# -- a plan at another instant -----------------------------------------------------------------------------


def plan_at(h: History, now: float, invalid: frozenset[str] = frozenset()) -> PrunePlan:
    request = PruneRequest(
        h.policy,
        STEP_RE,
        now,
        frozenset(h.in_flight),
        ROOTS,
        invalid=invalid,
        observed={("mirror", rel): 1e6 for rel in h.mirror},
    )
    return plan_prune(Snapshot(dict(h.primary)), Snapshot(dict(h.mirror), dict(h.partials)), dict(h.manifest), request)


def test_a_future_file_that_comes_of_age_is_planned_again() -> None:
    """A step stamped ahead of the clock is unknown in order until the clock passes the skew allowance:
    the plan made just after that moment reads it again (here: the rollback it shows appears)."""
    h = synced(range(1, 5))
    ahead = NOW + 600
    h.primary["run/step_0002.pt"] = FileState("run/step_0002.pt", 100, int(ahead * NS), ino=2)
    before = plan_at(h, NOW)
    assert before.rollbacks == {}
    after = plan_at(h, ahead - h.policy.future_skew_seconds)
    assert after.rollbacks == {"run": ((4, 2),)}


@PROPERTY
@given(histories())
def test_a_plans_retirement_retires_what_the_plan_retires_and_holds_no_file(h: History) -> None:
    """What the daemon keeps of its last plan between rescans (to judge the files a watch event names) says
    retired for exactly the steps the whole plan does, with any mtime, and holds none of its per-file
    decisions or the guards' observations."""
    plan = plan_at(h, NOW)
    kept = plan.retirement()
    runs = {rel.rpartition("/")[0] for rel in (*h.primary, *h.mirror)} | {"elsewhere"}
    for run in runs:
        for step in (None, *range(-1, 42)):
            for mtime in (None, 0, MTIMES["old"], MTIMES["future"]):
                assert kept.retired(run, step, mtime) == plan.retired(run, step, mtime)
    assert (kept.deletions, tuple(kept.kept), kept.skipped, kept.guards) == ((), (), (), None)
    assert set(kept.preserved) <= set(kept.windows)


# -- evidence, not proxies (issue 32 item 3, issue 33 cases 7 and 8) ----------------------------------------


def plan_with(h: History, **request: object) -> PrunePlan:
    return plan_prune(
        Snapshot(dict(h.primary)),
        Snapshot(dict(h.mirror)),
        dict(h.manifest),
        PruneRequest(h.policy, STEP_RE, NOW, roots=ROOTS, **request),
    )  # type: ignore[arg-type]


def test_a_run_whose_primary_lost_its_newest_verified_step_is_paused_until_a_newer_one_verifies() -> None:
    """Steps 1-5 mirrored, the primary wiped: nothing of the run is deleted, on either side, and the plan
    names the paused run; a newer step verified on the mirror (here 6) ends the pause."""
    h = synced(range(1, 6))
    h.primary.clear()
    plan = plan_with(h)
    assert plan.paused == {"run": 5} and plan.deletions == ()
    assert {k.why for k in plan.kept if k.step in (1, 2)} == {"paused"}
    assert plan_with(h, forget=frozenset({("run", 5)})).paused == {}
    h.primary["run/step_0006.pt"] = h.mirror["run/step_0006.pt"] = FileState(
        "run/step_0006.pt", 100, MTIMES["old"] + 6, ino=6
    )
    h.manifest["run/step_0006.pt"] = ManifestEntry("run/step_0006.pt", 100, "blake3", "00", MTIMES["old"] + 6, 6, NOW)
    assert plan_with(h).paused == {} and {d.step for d in plan_with(h).deletions} == {1, 2, 3}


def test_a_touched_mirror_copy_keeps_its_recorded_place_in_the_order() -> None:
    """Step 10 left the primary and its mirror copy was touched: its place comes from the manifest's record,
    so 20 and 30 are the newest; the touched copy is unconfirmed (neither counted nor deleted), reported as
    skipped for that reason (no guard vetoes it: it was touched an hour ago)."""
    h = History(PruneConfig(keep_last=2, primary=True))
    for step in (10, 20, 30):
        rel = f"run/step_{step:04d}.pt"
        h.primary[rel] = FileState(rel, 100, MTIMES["old"] + step, ino=step)
        h.mirror[rel] = FileState(rel, 100, MTIMES["old"] + step, ino=100 + step)
        h.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", MTIMES["old"] + step, step, NOW)
    del h.primary["run/step_0010.pt"]
    h.mirror["run/step_0010.pt"] = FileState("run/step_0010.pt", 100, int((NOW - 3_600) * NS), ino=110)
    plan = plan_with(h)
    assert plan.rollbacks == {} and plan.deletions == ()
    assert {(k.step, k.why) for k in plan.kept} == {(20, "keep_last"), (30, "keep_last")}
    assert {(s.volume, s.step, s.reason) for s in plan.skipped} == {("mirror", 10, "unconfirmed")}
    assert plan.held == {"unconfirmed": 1}


def test_steps_mirrored_while_newer_ones_are_queued_are_not_pruned_in_that_pass() -> None:
    """Issue 34's starved queue: the small lane mirrors step 3 and then 7 while 4-6 (big) are still
    queued. The window (3 newest present) would retire 1-3 at once; while 4-6 are not verified whole
    on the mirror, nothing goes, and what was just mirrored stays."""
    h = synced(range(1, 3))
    h.policy = PruneConfig(keep_last=3, primary=False)
    for step in range(3, 8):
        rel = f"run/step_{step:04d}.pt"
        h.primary[rel] = FileState(rel, 100, MTIMES["old"] + step, ino=step)
        if step in (3, 7):
            h.mirror[rel] = FileState(rel, 100, MTIMES["old"] + step, ino=100 + step)
            h.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", MTIMES["old"] + step, step, NOW)
        else:
            h.in_flight.add(rel)
    plan = h.plan()
    assert plan.deletions == ()
    assert {(k.step, k.why) for k in plan.kept if k.volume == "mirror"} == {
        (1, "newer_unverified"),
        (2, "keep_last"),
        (3, "keep_last"),
        (7, "keep_last"),
    }


def test_a_step_without_evidence_of_wholeness_never_retires_a_whole_one() -> None:
    """keep_last 1: step 2 is recorded "unchecked" (no validator read it): step 1 (validated ok) stays on
    both sides; once step 3 is recorded "ok", 1 and 2 go."""
    h = synced(range(1, 3))
    h.policy = PruneConfig(keep_last=1, primary=True)
    for rel, e in list(h.manifest.items()):
        h.manifest[rel] = ManifestEntry(
            rel,
            e.size,
            e.algo,
            e.digest,
            e.source_mtime_ns,
            e.step,
            e.mirrored_at,
            validation="unchecked" if e.step == 2 else "ok",
        )
    plan = plan_with(h)
    assert plan.deletions == () and {k.why for k in plan.kept if k.step == 1} == {"newer_unverified"}
    rel = "run/step_0003.pt"
    h.primary[rel] = h.mirror[rel] = FileState(rel, 100, MTIMES["old"] + 3, ino=3)
    h.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", MTIMES["old"] + 3, 3, NOW, validation="ok")
    assert {d.step for d in plan_with(h).deletions} == {1, 2}


def test_the_folder_a_deepspeed_latest_tag_names_on_the_mirror_is_kept(tmp_path: Path) -> None:
    """keep_last 1, global_step8 and global_step9 verified, the mirror's `latest` still naming global_step8
    (the tag is mirrored after the folder it names): global_step8 stays until the tag moves on."""
    from mirrord.store.aliases import pointed_targets

    layout = layout_for("deepspeed")
    h = History(PruneConfig(keep_last=1))
    for step in (8, 9):
        rel = f"run/global_step{step}/mp_rank_00_model_states.pt"
        h.primary[rel] = FileState(rel, 100, MTIMES["old"] + step, ino=step)
        h.mirror[rel] = FileState(rel, 100, MTIMES["old"] + step, ino=100 + step)
        h.manifest[rel] = ManifestEntry(rel, 100, "blake3", "00", MTIMES["old"] + step, step, NOW)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("global_step8")
    pointed = pointed_targets(tmp_path, {"run"}, layout)
    assert pointed == {"run/global_step8"}

    def plan(named: frozenset[str]) -> PrunePlan:
        return plan_prune(
            Snapshot(dict(h.primary)),
            Snapshot(dict(h.mirror)),
            dict(h.manifest),
            PruneRequest(h.policy, re.compile(layout.step_pattern), NOW, layout=layout, pointed=named),
        )

    assert plan(pointed).deletions == () and {k.why for k in plan(pointed).kept if k.step == 8} == {"pointer"}
    (tmp_path / "run" / "latest").write_text("global_step9")
    assert {d.step for d in plan(pointed_targets(tmp_path, {"run"}, layout)).deletions} == {8}


def test_keep_branch_tips_keeps_each_abandoned_branchs_newest_verified_step() -> None:
    """Branches 0 (1, 2, 3 with 3 unverified) and 1 (2, 3 again) under branch 2: the tips are 2 and 3."""
    from mirrord.core.branches import Branches
    from mirrord.core.retention import KeepBranchTips

    run = Branches({1: 0, 2: 1, 3: 1, 5: 2}, ((3, 2), (3, 1)))
    assert KeepBranchTips().preserve([1, 2, 3, 5], {1, 2, 3, 5}, run) == {1, 3}
    assert KeepBranchTips().preserve([1, 2, 3, 5], {1, 2}, run) == {1, 2}
    assert KeepBranchTips().preserve([1, 2, 3, 5], set(), run) == {1, 3}


def test_versions_beside_a_copy_are_retired_by_their_own_rules() -> None:
    """A pending version goes once a newer copy is recorded under its name, a previous one once its run recorded
    a newer step (a stepless one: once the copy that took its name is whole), either once its name is no longer
    recorded; a version with no record, or one still needed, stays."""

    def entry(path: str, step: int | None, seq: int, role: str = "", validation: str = "renamed") -> ManifestEntry:
        return ManifestEntry(
            path, 10, "sha256", "d", MTIMES["old"], step, NOW, validation=validation, role=role, seq=seq
        )

    manifest = {
        e.path: e
        for e in (
            entry("r/step_3.pt", 3, 5),
            entry(version_key("r/step_3.pt"), 3, 4, PENDING),  # superseded by seq 5: retired
            entry("r/step_4.pt", 4, 6),
            entry(version_key("r/step_4.pt"), 4, 7, PENDING),  # still newer than the copy: kept
            entry(version_key("r/step_3.pt", 2), 3, 2, PREVIOUS),  # step 4 is recorded: retired
            entry(version_key("r/step_4.pt", 3), 4, 3, PREVIOUS),  # step 4 is the newest: kept
            entry(version_key("r/step_1.pt", 1), 1, 1, PREVIOUS),  # its name is gone: retired
            entry("r/model.pt", None, 8, validation="unchecked"),
            entry(version_key("r/model.pt", 7), None, 7, PREVIOUS),  # the copy at its name is not whole: kept
        )
    }
    versions = {rel: FileState(rel, 10, MTIMES["old"], 1) for rel in manifest if rel.startswith(".")}
    versions[".mirrord-versions/r/step_9.pt@9"] = FileState(".mirrord-versions/r/step_9.pt@9", 10, MTIMES["old"], 1)
    retired = {d.rel for d in retired_versions(Snapshot(versions=versions), manifest)}
    assert retired == {version_key("r/step_3.pt"), version_key("r/step_3.pt", 2), version_key("r/step_1.pt", 1)}
    manifest["r/model.pt"] = entry("r/model.pt", None, 8)
    assert version_key("r/model.pt", 7) in {d.rel for d in retired_versions(Snapshot(versions=versions), manifest)}
