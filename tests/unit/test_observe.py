"""Our own observation, on the monotonic clock: a wall-clock step can delay a deletion, never hasten it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mirrord.commands.prune import Pruner
from mirrord.commands.sync import run_sync
from mirrord.config import Config
from mirrord.core.model import FileState
from mirrord.core.observe import Observations
from mirrord.obs.metrics import Metrics
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
    config = make_config(prune={"keep_last": 1, "primary": True, "min_age_seconds": 300},
                         copy={"free_space_reserve_bytes": 0})
    for step in (1, 2):
        save_checkpoint(config.primary / "r" / f"step_{step}.pt", step)
    unpruned = config.model_copy(update={"prune": config.prune.model_copy(update={"enabled": False})})
    assert run_sync(unpruned).ok
    clock = Clock()
    mirror = LocalMirror(config.mirror)
    manifest = mirror.read_manifest()
    pruner = Pruner(config, LocalVolume(config.primary), mirror, manifest, Metrics(),
                    wall=lambda: 1_700_000_000 + 86_400.0, observations=Observations(clock))
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
