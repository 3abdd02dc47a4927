"""Our own observation, on the monotonic clock: a wall-clock step can delay a deletion, never hasten it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from mirrord.commands.sync import run_sync
from mirrord.config import Config
from mirrord.core.model import FileState
from mirrord.core.observe import Observations
from mirrord.obs.metrics import Metrics
from mirrord.service.pruner import Pruner
from mirrord.store.volume import LocalMirror, LocalVolume
from tests.support.checkpoints import save_checkpoint


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_file_is_seen_for_as_long_as_it_stays_the_same() -> None:
    clock = Clock()
    seen = Observations(clock)
    state = FileState("r/step_1.pt", 10, 5, ino=1, ctime_ns=7)
    assert seen.seen_for("primary", state) == 0.0
    clock.now += 30
    assert seen.seen_for("primary", state) == 30.0
    assert seen.seen_for("mirror", state) == 0.0  # each volume on its own
    assert seen.seen_for("primary", replace(state, ctime_ns=8)) == 0.0  # changed: the count starts again
    clock.now += 5
    assert seen.seen_for("primary", replace(state, ctime_ns=8)) == 5.0
    seen.update("primary", [])  # gone from a complete listing: forgotten
    assert seen.seen_for("primary", replace(state, ctime_ns=8)) == 0.0


def test_the_daemons_pruner_deletes_only_after_min_age_of_its_own_observation(
    make_config: Callable[..., Config],
) -> None:
    """The wall clock is a day ahead of every mtime (as after `faketime +1d`): mtimes look old, yet
    nothing goes until the monotonic clock says min_age_seconds passed since mirrord first saw it."""
    config = make_config(
        prune={"keep_last": 1, "primary": True, "min_age_seconds": 300}, copy={"free_space_reserve_bytes": 0}
    )
    for step in (1, 2):
        save_checkpoint(config.primary / "r" / f"step_{step}.pt", step)
    unpruned = config.model_copy(update={"prune": config.prune.model_copy(update={"enabled": False})})
    assert run_sync(unpruned).ok
    clock = Clock()
    mirror = LocalMirror(config.mirror)
    manifest = mirror.read_manifest()
    pruner = Pruner(
        config,
        LocalVolume(config.primary),
        mirror,
        manifest,
        Metrics(),
        wall=lambda: 1_700_000_000 + 86_400.0,
        observations=Observations(clock),
    )
    first = pruner.run_cycle()
    assert first.deleted == [] and {s.reason for s in first.skipped} == {"recently_seen"}
    clock.now += 299
    assert pruner.run_cycle().deleted == []
    clock.now += 1
    deleted = {(d.volume, d.rel) for d in pruner.run_cycle().deleted}
    assert deleted == {("primary", "r/step_1.pt"), ("mirror", "r/step_1.pt")}
    manifest.close()


def test_a_complete_listing_keeps_the_age_of_what_it_lists_and_forgets_only_its_own_volume() -> None:
    """update() is seen_for over a whole listing: unchanged files keep counting, a changed one starts
    again, a file missing from the listing is forgotten, and the other volume is untouched."""
    clock = Clock()
    seen = Observations(clock)
    a, b = FileState("r/step_1.pt", 10, 5, ino=1, ctime_ns=7), FileState("r/step_2.pt", 10, 5, ino=2, ctime_ns=7)
    assert seen.update("primary", [a, b]) == {("primary", a.rel): 0.0, ("primary", b.rel): 0.0}
    assert seen.update("mirror", [a]) == {("mirror", a.rel): 0.0}
    clock.now += 10
    assert seen.update("primary", [a, replace(b, size=11)]) == {("primary", a.rel): 10.0, ("primary", b.rel): 0.0}
    clock.now += 5
    assert seen.update("primary", [b]) == {("primary", b.rel): 0.0}  # b as first listed: changed since
    assert seen.seen_for("mirror", a) == 15.0
    clock.now += 1
    assert seen.update("primary", [a]) == {("primary", a.rel): 0.0}  # a was forgotten: seen anew


def test_a_file_first_seen_after_the_others_keeps_its_own_age_across_listings() -> None:
    """The files seen since the first listing are the old ones; one that came later (or changed) counts from
    its own first sight, however many listings follow: never from the first listing's (that would let the
    min-age guard pass a young file)."""
    clock = Clock()
    seen = Observations(clock)
    a, b = FileState("r/step_1.pt", 10, 5, ino=1, ctime_ns=7), FileState("r/step_2.pt", 10, 5, ino=2, ctime_ns=7)
    seen.update("primary", [a])
    clock.now += 10
    assert seen.update("primary", [a, b]) == {("primary", a.rel): 10.0, ("primary", b.rel): 0.0}
    clock.now += 5
    assert seen.update("primary", [a, b]) == {("primary", a.rel): 15.0, ("primary", b.rel): 5.0}
    clock.now += 5
    assert seen.update("primary", [a, b]) == {("primary", a.rel): 20.0, ("primary", b.rel): 10.0}
    changed = replace(a, ctime_ns=8)
    assert seen.update("primary", [changed, b]) == {("primary", a.rel): 0.0, ("primary", b.rel): 10.0}
    clock.now += 2
    assert seen.update("primary", [changed, b]) == {("primary", a.rel): 2.0, ("primary", b.rel): 12.0}
    assert seen.seen_for("primary", b) == 12.0 and seen.seen_for("primary", changed) == 2.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["update", "seen_for"]),
            st.sampled_from(["primary", "mirror"]),
            st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 2), max_size=6),
            st.integers(0, 7),
        ),
        max_size=25,
    )
)
def test_observations_agree_with_a_plain_record_of_every_file(
    steps: list[tuple[str, str, dict[str, int], int]],
) -> None:
    """Whatever the sequence of listings and single looks: the age of every file is what a plain record of
    (identity, first seen unchanged) per file gives, both from each listing's Ages (also read later, after
    other looks) and from seen_for."""
    clock = Clock()
    seen = Observations(clock)
    plain: dict[str, dict[str, tuple[tuple[int, int, int, int], float]]] = {}
    given_ages: list[tuple[Mapping[tuple[str, str], float], dict[tuple[str, str], float], float]] = []
    for kind, volume, files, tick in steps:
        clock.now += tick
        states = [FileState(f"r/{name}.pt", 10, 5, ino=ord(name), ctime_ns=version) for name, version in files.items()]
        record = plain.setdefault(volume, {})
        if kind == "update":
            ages = seen.update(volume, {s.rel: s for s in states} if tick % 2 else states)
            kept = {}
            for s in states:
                before = record.get(s.rel)
                kept[s.rel] = before if before is not None and before[0] == s.identity else (s.identity, clock.now)
            plain[volume] = kept
            expected = {(volume, rel): clock.now - since for rel, (_identity, since) in kept.items()}
            assert dict(ages) == expected
            given_ages.append((ages, {k: clock.now - v for k, v in expected.items()}, clock.now))
        else:
            for s in states:
                before = record.get(s.rel)
                if before is None or before[0] != s.identity:
                    record[s.rel] = (s.identity, clock.now)
                assert seen.seen_for(volume, s) == clock.now - record[s.rel][1]
    # An earlier listing's ages read now: never older than what that listing said (a later look at a changed
    # file can only make it younger).
    for ages, since_then, then in given_ages:
        for key, first_seen in since_then.items():
            age = ages.get(key)
            assert age is not None and age <= then - first_seen


def test_a_listing_observed_as_a_map_is_kept_as_it_is_and_never_changed() -> None:
    """A listing's own map of files is observed without a copy; a later look at a changed file is recorded
    in a copy of it, never in the listing's map (a snapshot is never changed), and makes the file younger
    in the ages that update gave."""
    clock = Clock()
    seen = Observations(clock)
    a, b = FileState("r/step_1.pt", 10, 5, ino=1, ctime_ns=7), FileState("r/step_2.pt", 10, 5, ino=2, ctime_ns=7)
    files = {a.rel: a, b.rel: b}
    seen.update("primary", dict(files))
    clock.now += 10
    listed = dict(files)
    ages = seen.update("primary", listed)
    assert dict(ages) == {("primary", a.rel): 10.0, ("primary", b.rel): 10.0}
    changed = replace(a, ctime_ns=8)
    assert seen.seen_for("primary", changed) == 0.0
    assert listed == files and listed[a.rel] is a
    assert dict(ages) == {("primary", a.rel): 0.0, ("primary", b.rel): 10.0}
    clock.now += 3
    assert seen.seen_for("primary", changed) == 3.0 and seen.seen_for("primary", b) == 13.0
