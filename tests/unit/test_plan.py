"""The copy planner is a pure function of two snapshots, the manifest and a settle predicate."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest

from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.plan import MTIME_TOLERANCE_NS, SettleTracker, plan_copies, why_copy

STEP = re.compile(r"step_(\d+)")
S = 10**9
T0 = 1_700_000_000 * S


def src(rel: str, size: int = 100, mtime_ns: int = T0) -> FileState:
    return FileState(rel, size, mtime_ns)


def entry(state: FileState, size: int | None = None, mtime_ns: int | None = None) -> ManifestEntry:
    return ManifestEntry(
        path=state.rel,
        size=state.size if size is None else size,
        algo="blake3",
        digest="d" * 64,
        source_mtime_ns=state.mtime_ns if mtime_ns is None else mtime_ns,
        step=None,
        mirrored_at=0.0,
    )


def snap(*states: FileState) -> Snapshot:
    return Snapshot({s.rel: s for s in states})


# --- why_copy -----------------------------------------------------------------------------------------


def test_new_when_neither_mirror_nor_manifest_has_it() -> None:
    assert why_copy(src("a.pt"), None, None) == "new"


def test_unrecorded_when_the_mirror_has_a_file_the_manifest_does_not_vouch_for() -> None:
    """A file of the same size and mtime (left by cp, or published before a crash) is still not trusted."""
    s = src("a.pt")
    assert why_copy(s, None, s) == "unrecorded"


@pytest.mark.parametrize(("dsize", "dmtime"), [(1, 0), (-1, 0), (0, 1), (0, -1)])
def test_changed_when_the_source_differs_from_what_was_recorded(dsize: int, dmtime: int) -> None:
    """Size or mtime (to the nanosecond) differs from the manifest: the trainer rewrote it."""
    s = src("a.pt")
    recorded = entry(s, size=s.size + dsize, mtime_ns=s.mtime_ns + dmtime)
    assert why_copy(s, recorded, s) == "changed"


def test_mirror_missing_when_recorded_but_gone() -> None:
    s = src("a.pt")
    assert why_copy(s, entry(s), None) == "mirror_missing"


def test_mirror_mismatch_when_the_mirror_copy_was_truncated() -> None:
    s = src("a.pt", size=2_470_000_000)
    truncated = FileState("a.pt", 1_820_000_000, s.mtime_ns)
    assert why_copy(s, entry(s), truncated) == "mirror_mismatch"


def test_mirror_mismatch_when_the_mirror_mtime_moved_beyond_tolerance() -> None:
    s = src("a.pt")
    touched = FileState("a.pt", s.size, s.mtime_ns + MTIME_TOLERANCE_NS + 1)
    assert why_copy(s, entry(s), touched) == "mirror_mismatch"


def test_in_sync_within_the_mtime_tolerance_of_coarse_filesystems() -> None:
    """FAT/SMB round the mtime we set; that alone must not cause endless re-copies."""
    s = src("a.pt", mtime_ns=T0 + 123_456_789)
    rounded = FileState("a.pt", s.size, T0)
    assert why_copy(s, entry(s), rounded) is None
    assert why_copy(s, entry(s), s) is None


def test_replaced_when_the_source_is_another_file_by_inode_or_ctime() -> None:
    """Issue 41 case 10: same size and mtime, but another inode (`rsync -a`, a restore) or ctime (`cp -p`
    rewrote it in place) than the source recorded: read again. A record without the identity says nothing."""
    copied = FileState("a.pt", 100, T0, ino=7, ctime_ns=T0 + 5)
    recorded = dataclasses.replace(entry(copied), source_ino=7, source_ctime_ns=T0 + 5)
    assert why_copy(copied, recorded, copied) is None
    assert why_copy(dataclasses.replace(copied, ino=8), recorded, copied) == "replaced"
    assert why_copy(dataclasses.replace(copied, ctime_ns=T0 + 6), recorded, copied) == "replaced"
    assert why_copy(dataclasses.replace(copied, ino=8), entry(copied), copied) is None


# --- plan_copies ----------------------------------------------------------------------------------------


def test_plan_lists_only_what_needs_copying_with_reasons() -> None:
    in_sync, new, changed, missing, truncated, unrecorded = (
        src(f"run/step_{i}.pt", mtime_ns=T0 + i * S) for i in range(1, 7)
    )
    primary = snap(in_sync, new, changed, missing, truncated, unrecorded)
    mirror = snap(in_sync, changed, FileState(truncated.rel, 1, truncated.mtime_ns), unrecorded)
    manifest = {e.path: e for e in (entry(in_sync), entry(changed, size=1), entry(missing), entry(truncated))}
    plan = plan_copies(primary, mirror, manifest, STEP)
    assert {j.rel: j.why for j in plan.jobs} == {
        new.rel: "new",
        changed.rel: "changed",
        missing.rel: "mirror_missing",
        truncated.rel: "mirror_mismatch",
        unrecorded.rel: "unrecorded",
    }
    assert plan.in_sync == 1 and plan.unsettled == ()


def test_plan_ignores_mirror_files_without_a_source() -> None:
    """Copying is one-way; deleting is retention's business, not the planner's."""
    orphan = src("gone/step_1.pt")
    plan = plan_copies(snap(), snap(orphan), {orphan.rel: entry(orphan)}, STEP)
    assert plan.jobs == () and plan.in_sync == 0


def test_newest_step_first_across_runs_then_newest_mtime_then_stepless() -> None:
    """The checkpoint a resume needs is copied first; files without a step come last."""
    files = [
        src("a/step_5.pt", mtime_ns=T0 + 50 * S),
        src("b/step_30.pt", mtime_ns=T0 + 1 * S),
        src("a/step_30.pt", mtime_ns=T0 + 2 * S),
        src("a/final.pt", mtime_ns=T0 + 99 * S),
        src("b/step_100.pt", mtime_ns=T0),
        src("b/best.pt", mtime_ns=T0 + 98 * S),
    ]
    plan = plan_copies(snap(*files), snap(), {}, STEP)
    assert [j.rel for j in plan.jobs] == [
        "b/step_100.pt",
        "a/step_30.pt",
        "b/step_30.pt",
        "a/step_5.pt",
        "a/final.pt",
        "b/best.pt",
    ]
    assert [j.step for j in plan.jobs] == [100, 30, 30, 5, None, None]
    assert {j.run for j in plan.jobs} == {"a", "b"}


def test_step_is_parsed_from_the_file_name_only() -> None:
    """A run folder called step_7 does not give its files step 7."""
    plan = plan_copies(snap(src("step_7/final.pt"), src("step_7/step_0042.pt")), snap(), {}, STEP)
    assert {j.rel: j.step for j in plan.jobs} == {"step_7/final.pt": None, "step_7/step_0042.pt": 42}


def test_unsettled_files_are_reported_not_planned() -> None:
    busy, done = src("r/step_2.pt"), src("r/step_1.pt")
    plan = plan_copies(snap(busy, done), snap(), {}, STEP, is_settled=lambda s: s.rel != busy.rel)
    assert [j.rel for j in plan.jobs] == [done.rel]
    assert plan.unsettled == (busy.rel,)


def test_in_sync_files_are_not_held_back_by_the_settle_check() -> None:
    s = src("r/step_1.pt")
    plan = plan_copies(snap(s), snap(s), {s.rel: entry(s)}, STEP, is_settled=lambda _s: False)
    assert plan.jobs == () and plan.unsettled == () and plan.in_sync == 1


def test_plan_does_not_mutate_its_inputs() -> None:
    primary, mirror = snap(src("r/step_1.pt")), snap()
    manifest: dict[str, ManifestEntry] = {}
    before = (dict(primary.files), dict(mirror.files))
    plan_copies(primary, mirror, manifest, STEP)
    assert (dict(primary.files), dict(mirror.files), manifest) == (*before, {})


# --- SettleTracker ------------------------------------------------------------------------------------


@dataclass
class Clocks:
    wall: float = T0 / S
    mono: float = 1000.0

    def tracker(self, settle: float = 2.0) -> SettleTracker:
        return SettleTracker(settle, lambda: self.wall, lambda: self.mono)

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def test_an_old_mtime_is_not_settled_at_first_sight() -> None:
    """Settled means observed: an hour-old mtime may come from a clock that lags (or a file still being
    appended to on a server whose clock is behind ours)."""
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    old = src("a.pt", mtime_ns=T0 - 3600 * S)
    assert not settled(old)
    clocks.mono += 1.9
    assert not settled(old)
    clocks.mono += 0.1
    assert settled(old)


def test_a_recent_mtime_adds_delay_never_removes_it() -> None:
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    fresh = src("a.pt", mtime_ns=T0)
    assert not settled(fresh)
    clocks.mono += 2.0  # seen unchanged long enough, but the wall clock says it was modified just now
    assert not settled(fresh)
    clocks.wall += 2.0
    assert settled(fresh)


def test_a_wall_clock_ahead_of_the_files_settles_nothing_that_keeps_changing() -> None:
    """The issue's faketime +30s case: a writer appending every 0.3 s is never settled."""
    clocks = Clocks(wall=T0 / S + 30)
    settled = clocks.tracker(2.0)
    for i in range(20):
        assert not settled(src("a.pt", size=100_000 * (i + 1), mtime_ns=T0 + int(i * 0.3 * S)))
        clocks.advance(0.3)


def test_a_change_restarts_the_observation() -> None:
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    assert not settled(src("a.pt", size=100, mtime_ns=T0))
    clocks.advance(1.5)
    assert not settled(src("a.pt", size=200, mtime_ns=T0))  # grew: still being written
    clocks.advance(1.5)
    assert not settled(src("a.pt", size=200, mtime_ns=T0))
    clocks.advance(0.5)
    assert settled(src("a.pt", size=200, mtime_ns=T0))


def test_a_ctime_change_restarts_the_observation() -> None:
    """Same size and mtime restored (a rewrite with utime): the ctime still moved."""
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    assert not settled(src("a.pt", mtime_ns=T0 - 10 * S))
    clocks.advance(1.5)
    rewritten = dataclasses.replace(src("a.pt", mtime_ns=T0 - 10 * S), ctime_ns=T0 + 2 * S)
    assert not settled(rewritten)
    clocks.advance(1.5)
    assert not settled(rewritten)
    clocks.advance(0.5)
    assert settled(rewritten)


def test_mtime_zero_says_nothing_about_age() -> None:
    """Some copy tools and FUSE bridges report mtime 0: 'very old' must not mean 'finished'."""
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    zero = src("a.pt", mtime_ns=0)
    assert not settled(zero)
    clocks.advance(1.0)
    assert not settled(zero)
    clocks.advance(1.0)
    assert settled(zero)


def test_future_mtime_says_nothing_about_age() -> None:
    """A writer with a skewed clock: the file's age is unknown, so only observation counts."""
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    future = src("a.pt", mtime_ns=T0 + 3600 * S)
    assert not settled(future)
    clocks.mono += 2.0
    assert settled(future)


def test_committed_by_rename_is_settled_at_once_until_it_changes() -> None:
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    fresh = src("a.pt", mtime_ns=T0)
    settled.mark_committed(fresh)
    assert settled(fresh)
    assert not settled(src("a.pt", size=fresh.size + 1, mtime_ns=T0))  # rewritten in place afterwards
    settled.forget("a.pt")
    assert not settled(fresh)


def test_zero_settle_seconds_settles_everything() -> None:
    assert Clocks().tracker(0.0)(src("a.pt", mtime_ns=T0))


def test_files_are_tracked_independently() -> None:
    clocks = Clocks()
    settled = clocks.tracker(2.0)
    a, b = src("a.pt", mtime_ns=T0), src("b.pt", mtime_ns=T0)
    assert not settled(a)
    clocks.advance(2.0)
    assert not settled(b)
    assert settled(a)


def test_sort_newest_first_orders_as_the_queue_key_does() -> None:
    """The two-sort version gives the order of sorting by newest_first, ties kept in their order."""
    import random

    from mirrord.core.jobs import CopyJob
    from mirrord.core.plan import newest_first, sort_newest_first

    rng = random.Random(7)
    for _ in range(200):
        jobs = [
            CopyJob(f"r/{i}.pt", 1, rng.choice([5, 6, 7, -1]), rng.choice([None, 0, 1, 2, -3, 10**30]), "new")
            for i in range(rng.randrange(0, 30))
        ]
        got = list(jobs)
        sort_newest_first(got)
        assert got == sorted(jobs, key=newest_first)
