"""Guards: pure vetoes on one deletion, each with a named reason; combining them can only keep more."""

from __future__ import annotations

import stat
from pathlib import PurePath

from hypothesis import given
from hypothesis import strategies as st

from mirrord.core import guards
from mirrord.core.guards import GUARDS, GuardContext, veto
from mirrord.core.model import FileState
from mirrord.store.scan import state_from_stat

NOW = 1_700_000_000.0
NS = 1_000_000_000
CTX = GuardContext(now=NOW, min_age_seconds=300, future_skew_seconds=60)


def state(rel: str = "run/step_0001.pt", age: float = 3600, mode: int = stat.S_IFREG | 0o644) -> FileState:
    return FileState(rel, 10, int((NOW - age) * NS), ino=1, mode=mode)


def test_old_regular_file_passes_every_guard() -> None:
    """A plain file older than min_age, not in flight and not the newest may be deleted."""
    assert veto("mirror", state(), CTX) is None
    assert [g("mirror", state(), CTX) for g in GUARDS] == [None] * len(GUARDS)


def test_recent_mtime_is_vetoed_up_to_min_age() -> None:
    """Modified less than min_age_seconds ago: it may be a copy in flight."""
    assert guards.recent_mtime("mirror", state(age=299), CTX) == "recent_mtime"
    assert guards.recent_mtime("mirror", state(age=1), CTX) == "recent_mtime"
    assert guards.recent_mtime("mirror", state(age=301), CTX) is None


def test_mtime_slightly_in_the_future_counts_as_recent() -> None:
    """Within the allowed skew a future mtime is not a lie, but it is certainly not old."""
    s = state(age=-30)
    assert guards.future_mtime("mirror", s, CTX) is None
    assert veto("mirror", s, CTX) == "recent_mtime"


def test_future_mtime_beyond_skew_is_vetoed() -> None:
    """An mtime an hour ahead means a lying clock or filesystem, not age."""
    assert veto("primary", state(age=-3600), CTX) == "future_mtime"
    assert guards.future_mtime("primary", state(age=-61), CTX) == "future_mtime"


def test_zero_or_pre_epoch_mtime_is_vetoed() -> None:
    """mtime 0 (the filesystem does not know) is unknown, and unknown is not old."""
    assert veto("mirror", FileState("a/step_1.pt", 10, 0), CTX) == "zero_mtime"
    assert veto("mirror", FileState("a/step_1.pt", 10, -5), CTX) == "zero_mtime"


def test_in_flight_covers_the_file_and_its_temp_name() -> None:
    """A queued or copying path is protected, and so is its NAME.part on the mirror."""
    ctx = GuardContext(NOW, 300, 60, in_flight=frozenset({"run/step_0001.pt"}))
    assert veto("primary", state(), ctx) == "in_flight"
    assert veto("mirror", state("run/step_0001.pt.part"), ctx) == "in_flight"
    assert veto("mirror", state("run/step_0002.pt"), ctx) is None


def test_newest_verified_checkpoint_is_vetoed() -> None:
    """The newest verified checkpoint of a run is what a resume needs."""
    ctx = GuardContext(NOW, 300, 60, newest=frozenset({"run/step_0001.pt"}))
    assert veto("mirror", state(), ctx) == "newest"


def test_not_regular_files_are_vetoed() -> None:
    """Symlinks, directories and FIFOs are never deleted by retention."""
    for mode in (stat.S_IFLNK | 0o777, stat.S_IFDIR | 0o755, stat.S_IFIFO | 0o644):
        assert veto("mirror", state(mode=mode), CTX) == "not_regular"


def test_paths_that_leave_the_root_are_vetoed() -> None:
    """'..', absolute, empty and non-canonical paths never reach an unlink."""
    for rel in ("../etc/passwd", "/etc/passwd", "run/../../x.pt", "", "run//x.pt", "run/./x.pt", "run/"):
        assert veto("mirror", state(rel), CTX) == "not_regular", rel


def test_path_inside_a_nested_root_is_vetoed() -> None:
    """A mirror nested in the primary would show up in the primary listing: never delete it from there."""
    roots = {"primary": PurePath("/data"), "mirror": PurePath("/data/mirror")}
    ctx = GuardContext(NOW, 300, 60, roots=roots)
    assert veto("primary", state("mirror/run/step_0001.pt"), ctx) == "not_regular"
    assert veto("primary", state("run/step_0001.pt"), ctx) is None
    assert veto("mirror", state("run/step_0001.pt"), ctx) is None


def test_unknown_volume_is_vetoed_when_roots_are_given() -> None:
    ctx = GuardContext(NOW, 300, 60, roots={"mirror": PurePath("/m")})
    assert veto("primary", state(), ctx) == "not_regular"


def test_first_reason_is_reported_and_all_are_listed() -> None:
    """veto() reports the most specific reason, the first of those that apply in guard order."""
    ctx = GuardContext(NOW, 300, 60, in_flight=frozenset({"run/step_0001.pt"}), newest=frozenset({"run/step_0001.pt"}))
    s = state(age=10)
    assert veto("mirror", s, ctx) == "in_flight"
    assert [r for r in (g("mirror", s, ctx) for g in GUARDS) if r] == ["in_flight", "recent_mtime", "newest"]


def test_every_reason_is_a_known_metric_label() -> None:
    from mirrord.obs.metrics import SKIP_REASONS

    assert set(guards.REASONS) <= set(SKIP_REASONS)


def test_state_from_real_stat_of_a_symlink_is_vetoed(tmp_path: PurePath) -> None:
    """A real lstat of a symlink (as a fresh re-stat would see it) is not a regular file."""
    from pathlib import Path

    target = Path(tmp_path) / "target.pt"
    target.write_bytes(b"x")
    link = Path(tmp_path) / "step_1.pt"
    link.symlink_to(target)
    assert veto("mirror", state_from_stat("step_1.pt", link.lstat()), CTX) == "not_regular"


states = st.builds(
    FileState,
    rel=st.sampled_from(["r/step_1.pt", "r/step_2.pt", "r/step_2.pt.part", "step_3.pt", "../x.pt"]),
    size=st.integers(0, 100),
    mtime_ns=st.one_of(st.just(0), st.integers(int((NOW - 10_000) * NS), int((NOW + 10_000) * NS))),
    ino=st.integers(1, 10),
    mode=st.sampled_from([stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777]),
)
contexts = st.builds(
    GuardContext,
    now=st.just(NOW),
    min_age_seconds=st.floats(0, 5000),
    future_skew_seconds=st.floats(0, 5000),
    in_flight=st.frozensets(st.sampled_from(["r/step_1.pt", "r/step_2.pt"])),
    newest=st.frozensets(st.sampled_from(["r/step_1.pt", "step_3.pt"])),
)


@given(states, contexts, st.sampled_from(["primary", "mirror"]))
def test_combined_veto_is_none_only_when_every_guard_allows(s: FileState, ctx: GuardContext, vol: str) -> None:
    """Combining guards can only keep more: one veto is enough, and the reported one is among them."""
    each = [g(vol, s, ctx) for g in guards.GUARDS]
    combined = veto(vol, s, ctx)
    assert (combined is None) == all(r is None for r in each)
    if combined is not None:
        assert combined in each
        assert combined in guards.REASONS


@given(states, contexts)
def test_a_file_that_passes_is_old_known_regular_and_not_in_flight(s: FileState, ctx: GuardContext) -> None:
    """Whatever passes the guards is a regular file with a known mtime at least min_age old."""
    if veto("mirror", s, ctx) is None:
        assert s.is_regular
        assert 0 < s.mtime_ns <= (ctx.now - ctx.min_age_seconds) * NS
        assert s.rel.removesuffix(".part") not in ctx.in_flight
        assert s.rel not in ctx.newest
