"""The daemon in-process: a fake clock, a fake watcher, real volumes, real copies on worker threads.

Each test drives the loop by hand (start, tick without waiting, shutdown), so time passes only when
the test moves the clock and hints arrive only when the test emits them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mirrord.config import Config
from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.core.retention import PruneRequest
from mirrord.errors import MirrordError, NoSpaceError
from mirrord.service.clock import Clock
from mirrord.service.daemon import Daemon, Volumes
from mirrord.service.engine import Engine
from mirrord.service.hints import TURN_SECONDS, one_turn
from mirrord.service.inbox import MAX_HINTS
from mirrord.service.ledger import RECOPY_LIMIT
from mirrord.service.pruner import Pruner
from mirrord.service.systemd import Notifier
from mirrord.service.watcher import Hint
from mirrord.store.volume import LocalMirror, LocalVolume
from tests.support.checkpoints import save_checkpoint
from tests.support.engine import copy_once
from tests.support.wait import wait_for

REL = "run/step_0007.pt"


@dataclass
class FakeClock:
    """Wall and monotonic time that move only when the test says so."""

    wall: float = 1_800_000_000.0
    mono: float = 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def clock(self) -> Clock:
        return Clock(wall=lambda: self.wall, monotonic=lambda: self.mono)


@dataclass
class FakeWatcher:
    """Stands for watchdog's observer: the test emits hints through `emit`."""

    emit: Callable[[Hint], None]
    mode: str
    journal: list[str]
    alive: bool = False

    def start(self) -> None:
        self.alive = True
        self.journal.append(f"watch.start {self.mode}")

    def is_alive(self) -> bool:
        return self.alive

    def unwatched(self) -> str | None:
        return None

    def stop(self) -> None:
        self.alive = False
        self.journal.append("watch.stop")


class RecordingNotifier(Notifier):
    """systemd's side of sd_notify, in a list."""

    def __init__(self, journal: list[str]) -> None:
        super().__init__(environ={})
        self.journal = journal

    def notify(self, *lines: str) -> None:
        self.journal.append(" ".join(line for line in lines if not line.startswith("STATUS=")) or lines[0])

    def close(self) -> None:
        self.journal.append("notifier.close")


@dataclass
class Harness:
    daemon: Daemon
    clock: FakeClock
    watchers: list[FakeWatcher]
    journal: list[str]
    reloads: list[tuple[Config, bool]] = field(default_factory=list)

    def hint(self, rel: str) -> None:
        """What the watcher reports when the trainer renames a finished checkpoint onto `rel`."""
        self.watchers[-1].emit(Hint(rel, committed=True))


@pytest.fixture
def harness(make_config: Callable[..., Config], primary: Path, mirror: Path) -> Iterator[Callable[..., Harness]]:
    """Build a daemon on the test's roots (metrics off, retention off unless asked); shut down at teardown."""
    made: list[Harness] = []
    stack = contextlib.ExitStack()

    def make(**sections: Any) -> Harness:
        sections = {
            "metrics": {"enabled": False},
            "prune": {"enabled": False},
            "watch": {"rescan_interval_seconds": 600},
            "daemon": {"heartbeat_seconds": 5},
            **sections,
        }
        config = make_config(**sections)
        clock, journal, watchers = FakeClock(), [], []
        lm = LocalMirror(config.mirror)
        stack.enter_context(lm.lock())

        def factory(
            root: Path, patterns: tuple[str, ...], mode: str, poll: float, emit: Callable[[Hint], None]
        ) -> FakeWatcher:
            watchers.append(FakeWatcher(emit, mode, journal))
            return watchers[-1]

        h = Harness(None, clock, watchers, journal)  # type: ignore[arg-type]
        volumes = Volumes(LocalVolume(config.primary), lm, lm.read_manifest())
        h.daemon = Daemon(
            config,
            lambda: h.reloads.pop(0),
            volumes,
            watcher_factory=factory,
            clock=clock.clock(),
            notifier=RecordingNotifier(journal),
        )
        made.append(h)
        return h

    yield make
    for h in made:
        if "notifier.close" not in h.journal:
            h.daemon.shutdown()
    stack.close()


def hang_first_read(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The copier's first read of all blocks like one on a dead NFS server, until `release` is set (at
    most 120 s); `stuck` is set once it blocks. Later reads go through."""
    stuck, release, first = threading.Event(), threading.Event(), threading.Lock()
    real_readv = os.readv

    def readv(fd: int, buffers: list[bytearray]) -> int:
        if first.acquire(blocking=False):
            stuck.set()
            release.wait(120)
        return real_readv(fd, buffers)

    monkeypatch.setattr("mirrord.service.copier.os.readv", readv)
    return stuck, release


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_a_hint_queues_a_copy_that_a_worker_makes_without_a_rescan(harness, primary, mirror, logs) -> None:
    """After the first reconcile, a checkpoint renamed into place is copied on its watch hint alone: the
    clock never reaches the next rescan, and no second reconcile runs."""
    h = harness()
    h.daemon.start()
    assert h.daemon.supervisor.readiness() == (True, "ready") and "READY=1" in h.journal
    assert len(events(logs, "reconcile.finished")) == 1
    src = save_checkpoint(primary / REL, 7)
    h.hint(REL)
    h.daemon.tick(wait=False)
    wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the hinted copy")
    assert (mirror / REL).read_bytes() == src.read_bytes()
    assert REL in h.daemon.manifest.entries
    assert len(events(logs, "reconcile.finished")) == 1
    assert [e["why"] for e in events(logs, "copy.started")] == ["new"]


def test_a_hint_dropped_while_the_mirror_is_refused_is_found_once_the_refusal_is_over(
    harness, primary, mirror, logs
) -> None:
    """A refusal (here the manifest's; the mirror not the pinned volume, an object store's lease) makes
    the loop drop the watch hints it drains, and a hint is the only word of a checkpoint until the next
    rescan: the moment nothing refuses, a full listing finds it, without waiting for the rescan interval."""
    h = harness()
    h.daemon.start()
    h.daemon.refusals.refuse("manifest", "the manifest cannot be written: test")
    src = save_checkpoint(primary / REL, 7)
    h.hint(REL)
    h.daemon.tick(wait=False)
    assert not h.daemon.inbox.hints and h.daemon.queue.depth() == 0 and h.daemon.ledger.copied == 0
    assert h.daemon.reconciler.next_deadline() > h.clock.mono  # nothing due while it still refuses
    h.daemon.refusals.refuse("manifest", None)
    assert h.daemon.reconciler.next_deadline() <= h.clock.mono  # due at once
    h.daemon.tick(wait=False)
    assert len(events(logs, "reconcile.finished")) == 2  # the clock never reached the rescan interval
    wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the copy once the refusal is over")
    assert (mirror / REL).read_bytes() == src.read_bytes()


def test_the_rescan_interval_on_the_fake_clock_finds_what_no_hint_announced(harness, primary, mirror, logs) -> None:
    """Events are hints, snapshots the truth: a file without a hint is found by the rescan when its
    interval has passed on the daemon's clock, and not before."""
    h = harness()
    h.daemon.start()
    save_checkpoint(primary / REL, 7)
    h.daemon.tick(wait=False)
    assert len(events(logs, "reconcile.finished")) == 1 and h.daemon.queue.depth() == 0
    h.clock.advance(600)
    h.daemon.tick(wait=False)
    assert len(events(logs, "reconcile.finished")) == 2
    wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the rescanned copy")
    assert (mirror / REL).exists()


def test_a_reload_swaps_the_settings_whole_and_a_refused_one_changes_nothing(harness, make_config, tmp_path) -> None:
    """SIGHUP with more workers and a new retry policy: one new Settings object, in force everywhere
    (pool size, retries, engine, settle); a reload that moves the mirror is refused and swaps nothing."""
    h = harness(copy={"workers": 1, "max_attempts": 2})
    h.daemon.start()
    before = h.daemon.settings
    bigger = make_config(
        metrics={"enabled": False},
        prune={"enabled": False},
        watch={"rescan_interval_seconds": 600},
        daemon={"heartbeat_seconds": 5},
        copy={"workers": 3, "max_attempts": 7, "settle_seconds": 2.5},
    )
    h.reloads.append((bigger, True))
    h.daemon.signals.reload_requested = True
    h.daemon.tick(wait=False)
    after = h.daemon.settings
    assert after is not before and after.config is bigger
    assert after.retry.max_attempts == 7 and h.daemon.pool.retry is after.retry
    assert h.daemon.engine.config is bigger and h.daemon.settle.settle_seconds == 2.5
    assert sum(t.is_alive() for t in h.daemon.pool.threads()) == 3
    assert "RELOADING=1" in h.journal

    moved = bigger.model_copy(update={"mirror": tmp_path / "elsewhere"})
    h.reloads.append((moved, True))
    h.daemon.signals.reload_requested = True
    h.daemon.tick(wait=False)
    assert h.daemon.settings is after


def test_a_copy_starting_during_a_reload_takes_one_config_whole(harness, make_config, primary, monkeypatch) -> None:
    """A reload that raises the free-space reserve past the mirror's free space and turns on retention (whose
    make_room is what a copy that does not fit calls) while a copy starts: the copy takes both settings of
    one config, the old (it fits) or the new (it asks retention for room), never the new reserve without
    retention (it would fail for no space without asking)."""
    h = harness()
    h.daemon.start()
    src = save_checkpoint(primary / REL, 7)
    job = CopyJob(REL, src.stat().st_size, src.stat().st_mtime_ns, 7, "new")
    asked: list[str] = []  # the threads whose copy asked retention for room (the daemon's workers copy too)
    monkeypatch.setattr(Pruner, "make_room", lambda self, needed: asked.append(threading.current_thread().name))
    outcomes: list[object] = []

    def copy() -> None:
        try:
            outcomes.append(copy_once(h.daemon.engine, job))
        except MirrordError as exc:
            outcomes.append(exc)

    def keep_modes_of(_primary: Path) -> None:  # the reload is under way: a copy starts now
        if not outcomes:
            worker = threading.Thread(target=copy, name="copy-during-reload")
            worker.start()
            worker.join(timeout=60)

    monkeypatch.setattr(h.daemon.mirror, "keep_modes_of", keep_modes_of)
    reloaded = make_config(
        metrics={"enabled": False},
        watch={"rescan_interval_seconds": 600},
        daemon={"heartbeat_seconds": 5},
        copy={"free_space_reserve_bytes": 2**60},
    )
    h.reloads.append((reloaded, True))
    h.daemon.signals.reload_requested = True
    h.daemon.tick(wait=False)
    assert h.daemon.settings.config.prune.enabled and len(outcomes) == 1
    assert isinstance(outcomes[0], CopyResult) or (
        isinstance(outcomes[0], NoSpaceError) and "copy-during-reload" in asked
    ), outcomes
    copy()  # and a copy after the reload takes the new config whole: it asks retention for room
    assert isinstance(outcomes[-1], NoSpaceError) and threading.current_thread().name in asked


def test_shutdown_is_ordered_and_bounded_even_with_a_copy_stuck_in_the_kernel(
    harness, primary, mirror, monkeypatch, logs
) -> None:
    """A copy blocked in read() (a hung mount) and a second stop signal: shutdown tells systemd, stops
    the watcher, cancels the copy, reports the worker it could not stop, closes the manifest and the
    notifier, and returns while the read is still blocked. The copy leaves no temp file behind."""
    h = harness()
    h.daemon.start()
    save_checkpoint(primary / REL, 7, width=256)
    stuck, release = hang_first_read(monkeypatch)
    h.hint(REL)
    h.daemon.tick(wait=False)
    assert stuck.wait(60), "the copy never started reading"
    h.daemon.signals.stop_requests = 2  # the second Ctrl-C: do not wait out the grace period
    try:
        h.daemon.shutdown()
        assert not release.is_set()  # shutdown returned while the copy was still stuck
        assert h.journal[h.journal.index("STOPPING=1") :] == ["STOPPING=1", "watch.stop", "notifier.close"]
        assert [e["event"] for e in logs if e["event"].startswith("daemon.")][-2:] == [
            "daemon.stopping",
            "daemon.copies_not_stopped",
        ]
    finally:
        release.set()
    wait_for(lambda: not any(t.is_alive() for t in h.daemon.pool.threads()), 60, "the copy thread to end")
    assert [e["why"] for e in events(logs, "copy.aborted")] == ["second stop signal"]
    assert not (mirror / REL).exists() and not list(mirror.rglob("*.part"))


def test_a_stalled_copy_is_reported_retried_and_a_wedged_worker_makes_the_daemon_unhealthy(
    harness, primary, mirror, monkeypatch, logs
) -> None:
    """No progress for stall_seconds on the daemon's clock: the heartbeat logs copy.stalled, counts it,
    hands the file to a fresh worker (which copies it), and after 3x stall_seconds reports the stuck
    worker as wedged in /healthz until its read returns."""
    h = harness(copy={"stall_seconds": 30, "workers": 1})
    h.daemon.start()
    src = save_checkpoint(primary / REL, 7)
    stuck, release = hang_first_read(monkeypatch)
    h.hint(REL)
    h.daemon.tick(wait=False)
    assert stuck.wait(60), "the copy never started reading"
    try:
        h.clock.advance(31)
        h.daemon.tick(wait=False)  # the heartbeat is due: it finds the stall
        [stalled] = events(logs, "copy.stalled")
        assert stalled["path"] == REL and stalled["seconds_without_progress"] >= 30
        assert h.daemon.metrics.copies.labels("stalled")._value.get() == 1
        wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the fresh worker's copy")
        assert (mirror / REL).read_bytes() == src.read_bytes()
        h.clock.advance(60)
        h.daemon.tick(wait=False)
        healthy, why = h.daemon.supervisor.health()
        assert not healthy and "wedged in run/step_0007.pt" in why
    finally:
        release.set()
    wait_for(lambda: events(logs, "copy.abandoned_returned"), 60, "the abandoned copy to return")
    assert not list(mirror.rglob("*.part"))


def test_stalled_copies_are_replaced_within_twice_the_pool_size_in_threads(
    harness, primary, mirror, monkeypatch, logs
) -> None:
    """On a hung mount every read blocks: the stalled copy's replacement stalls too, and is not replaced
    (one worker: two threads at most); /healthz says so. Once the reads return, a worker copies the file."""
    h = harness(copy={"stall_seconds": 30, "workers": 1})
    h.daemon.start()
    src = save_checkpoint(primary / REL, 7)
    reads, release, real_readv = [], threading.Event(), os.readv

    def readv(fd: int, buffers: list[bytearray]) -> int:
        reads.append(fd)
        release.wait(120)
        return real_readv(fd, buffers)

    monkeypatch.setattr("mirrord.service.copier.os.readv", readv)
    h.hint(REL)
    h.daemon.tick(wait=False)
    try:
        wait_for(lambda: len(reads) == 1, 60, "the copy to block in a read")
        h.clock.advance(31)
        h.daemon.tick(wait=False)  # stalled: abandoned and replaced
        wait_for(lambda: len(reads) == 2, 60, "the replacement to block in a read")
        for _ in range(3):
            h.clock.advance(31)
            h.daemon.tick(wait=False)  # the replacement stalled: not replaced
        assert len(events(logs, "copy.stalled")) == 2 and len(events(logs, "worker.not_replaced")) == 1
        assert len([t for t in h.daemon.pool.threads() if t.is_alive()]) == 2 and len(reads) == 2
        healthy, why = h.daemon.supervisor.health()
        assert not healthy and "1 copy worker(s) not replaced" in why
    finally:
        release.set()
    wait_for(lambda: len(events(logs, "copy.abandoned_returned")) == 2, 60, "the stuck copies to return")
    h.clock.advance(5)
    h.daemon.tick(wait=False)  # the heartbeat starts a worker again
    wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the copy")
    assert (mirror / REL).read_bytes() == src.read_bytes() and h.daemon.supervisor.health()[0]


def test_a_file_copied_in_a_loop_is_a_job_again_once_its_source_changes_and_forgotten_once_gone(
    harness, primary, mirror, logs
) -> None:
    """Two mirror copies whose mtime is reset behind mirrord's back at every rescan are re-copied RECOPY_LIMIT
    times, then reported (copy.loop) and left alone; the trainer saves one of them again: that new version
    is copied; the other is deleted from the primary: no longer reported either."""
    h = harness()
    kept, gone = REL, "run/step_0009.pt"
    save_checkpoint(primary / kept, 7)
    save_checkpoint(primary / gone, 9)
    h.daemon.start()

    def meddle_and_rescan() -> None:
        for rel in (kept, gone):
            os.utime(mirror / rel, ns=(10**9, 10**9))
        h.clock.advance(600)
        h.daemon.tick(wait=False)

    for copies in range(2, 2 * (RECOPY_LIMIT + 2), 2):
        wait_for(lambda n=copies: h.daemon.ledger.copied == n, 60, f"{copies} copies")
        meddle_and_rescan()
    assert sorted(e["path"] for e in events(logs, "copy.loop")) == [kept, gone]
    sample = h.daemon.metrics.registry.get_sample_value
    assert sample("mirrord_copy_loop_files") == 2 and h.daemon.queue.depth() == 0
    meddle_and_rescan()
    assert h.daemon.queue.depth() == 0 and h.daemon.ledger.copied == 2 * (RECOPY_LIMIT + 1)
    src = save_checkpoint(primary / kept, 8)
    (primary / gone).unlink()
    h.clock.advance(600)
    h.daemon.tick(wait=False)
    wait_for(lambda: h.daemon.ledger.copied == 2 * (RECOPY_LIMIT + 1) + 1, 60, "the new version's copy")
    assert (mirror / kept).read_bytes() == src.read_bytes()
    assert sample("mirrord_copy_loop_files") == 0 and "loop" not in h.daemon.ledger.status(0, 0)


def test_an_event_storm_holds_each_hint_once_and_past_the_bound_turns_into_one_rescan(
    harness, primary, mirror, logs
) -> None:
    """While the loop is busy, the watch repeats the same events: each waits once. Past MAX_HINTS distinct
    hints waiting, they are dropped for one full rescan, which still copies every file."""
    h = harness()
    h.daemon.start()
    rels = [f"run/step_{i:04d}.pt" for i in range(3)]
    for step, rel in enumerate(rels):
        save_checkpoint(primary / rel, step)
    for _ in range(1000):
        for rel in rels:
            h.hint(rel)
    assert list(h.daemon.inbox.hints) == [Hint(rel, committed=True) for rel in rels]
    for i in range(MAX_HINTS):
        h.hint(f"run/other_{i}.pt")
    assert len(h.daemon.inbox.hints) <= MAX_HINTS
    h.daemon.tick(wait=False)
    assert len(events(logs, "reconcile.finished")) == 2 and events(logs, "watch.rescan")
    wait_for(lambda: h.daemon.ledger.copied == len(rels), 60, "every file copied")
    assert all((mirror / rel).exists() for rel in rels)


def test_a_checkpoint_without_a_step_is_warned_about_once_even_when_it_appears_at_a_later_rescan(
    harness, primary, logs
) -> None:
    """A rescan judges naming only for files new since the last full listing: one that arrives later is
    still warned about (once per pattern), one already judged is not judged again."""
    h = harness()
    save_checkpoint(primary / REL, 7)
    h.daemon.start()
    assert events(logs, "checkpoint.no_step") == []
    save_checkpoint(primary / "run" / "final.pt", 8)
    for _ in range(2):
        h.clock.advance(600)
        h.daemon.tick(wait=False)
    assert len(events(logs, "reconcile.finished")) == 3
    assert [(e["path"], e["pattern"]) for e in events(logs, "checkpoint.no_step")] == [("run/final.pt", "*.pt")]


def slow_primary_stats(h: Harness, seconds: float) -> None:
    """Each stat of a primary file takes `seconds` on the daemon's clock (a busy host, a slow disk)."""
    real = h.daemon.primary.stat

    def stat(rel: str) -> Any:
        h.clock.advance(seconds)
        return real(rel)

    h.daemon.primary.stat = stat  # type: ignore[method-assign]


def test_a_burst_of_hints_is_handled_a_turn_at_a_time_with_the_heartbeat_between_turns(
    harness, primary, mirror, logs
) -> None:
    """Thousands of checkpoints committed at once are not one pass of the loop: each turn handles the
    hints of TURN_SECONDS on the daemon's clock (at least one), leaves the rest queued, and the heartbeat
    (WATCHDOG=1) runs before the next turn. Every hinted file is still copied, without a rescan."""
    h = harness(daemon={"heartbeat_seconds": 0.1})
    h.daemon.start()
    rels = [f"run/step_{i:04d}.pt" for i in range(12)]
    for step, rel in enumerate(rels):
        save_checkpoint(primary / rel, step)
    slow_primary_stats(h, TURN_SECONDS * 0.6)  # two hints per turn, then the heartbeat is due again
    for rel in rels:
        h.hint(rel)
    left, pings = [], []
    while h.daemon.inbox.hints:
        h.daemon.tick(wait=False)
        left.append(len(h.daemon.inbox.hints))
        pings.append(h.journal.count("WATCHDOG=1"))
    assert left == sorted(left, reverse=True) and left[0] == len(rels) - 2 and left[-1] == 0
    assert len(left) == len(rels) // 2
    assert pings == sorted(pings) and len(set(pings)) == len(pings), "a heartbeat after every turn"
    wait_for(lambda: h.daemon.ledger.copied == len(rels), 60, "every hinted copy")
    assert all((mirror / rel).exists() for rel in rels)
    assert len(events(logs, "reconcile.finished")) == 1


def test_a_settle_recheck_of_many_files_is_one_round_in_turns(harness, primary, mirror, logs) -> None:
    """Files written in place (no rename, no hint) wait to settle; the recheck of many of them looks at
    the files of one turn per tick and goes on at the next tick (no wait in between) until the round has
    looked at every file: each is queued once it has settled, and the heartbeat runs between turns."""
    h = harness(copy={"settle_seconds": 1.0}, daemon={"heartbeat_seconds": 0.1})
    rels = [f"run/step_{i:04d}.pt" for i in range(9)]
    for step, rel in enumerate(rels):
        save_checkpoint(primary / rel, step)
    h.daemon.start()
    assert h.daemon.reconciler.unsettled == set(rels) and h.daemon.queue.depth() == 0
    h.clock.advance(1.5)  # settled by now: the recheck finds them so
    slow_primary_stats(h, TURN_SECONDS * 0.4)  # three files per turn
    unsettled, pings = [], []
    while h.daemon.reconciler.unsettled:
        assert h.daemon.reconciler.next_deadline() <= h.clock.mono  # the round goes on at once
        h.daemon.tick(wait=False)
        unsettled.append(len(h.daemon.reconciler.unsettled))
        pings.append(h.journal.count("WATCHDOG=1"))
    assert unsettled == [6, 3, 0]
    assert len(set(pings)) == len(pings), "a heartbeat after every turn"
    assert h.daemon.reconciler.next_deadline() > h.clock.mono  # the round is over: the loop may sleep
    wait_for(lambda: h.daemon.ledger.copied == len(rels), 60, "every settled copy")
    assert all((mirror / rel).exists() for rel in rels)
    assert len(events(logs, "reconcile.finished")) == 1


def test_a_turn_takes_one_item_that_counts_then_more_only_while_its_time_lasts() -> None:
    """The turn helper the loops share: items with nothing to do are dropped without using up the turn's
    guaranteed first item, the clock decides after that, a false `go_on` stops before the next item is
    taken, and what is left stays pending."""
    now = [0.0]
    pending = list(range(10))
    taken = []
    for item in one_turn(lambda: now[0], pending, pending.pop, counts=lambda i: i < 7):
        taken.append(item)
        now[0] += TURN_SECONDS * 0.6
    assert taken == [6, 5] and pending == [0, 1, 2, 3, 4]  # 9, 8, 7 dropped: they did not count
    taken = []
    for item in one_turn(lambda: now[0], pending, pending.pop):
        taken.append(item)
        now[0] += 10 * TURN_SECONDS  # an item slower than a whole turn: the turn still did one
    assert taken == [4] and pending == [0, 1, 2, 3]
    stop = [False]
    taken = []
    for item in one_turn(lambda: now[0], pending, pending.pop, go_on=lambda: not stop[0]):
        taken.append(item)
        stop[0] = True
    assert taken == [3] and pending == [0, 1, 2]
    stop[0] = True
    assert list(one_turn(lambda: now[0], pending, pending.pop, go_on=lambda: not stop[0])) == []
    assert pending == [0, 1, 2]


def slow_listings(h: Harness, seconds: float, during_mirror: list[Callable[[], None]]) -> None:
    """Each full listing of either volume takes `seconds` on the daemon's clock; what is in `during_mirror`
    runs while the mirror is listed."""
    real_primary, real_mirror = h.daemon.primary.snapshot, h.daemon.mirror.snapshot

    def primary_snapshot(*args: Any, **kwargs: Any) -> Any:
        h.clock.advance(seconds)
        return real_primary(*args, **kwargs)

    def mirror_snapshot(*args: Any, **kwargs: Any) -> Any:
        h.clock.advance(seconds)
        for call in during_mirror:
            call()
        return real_mirror(*args, **kwargs)

    h.daemon.primary.snapshot = primary_snapshot  # type: ignore[method-assign]
    h.daemon.mirror.snapshot = mirror_snapshot  # type: ignore[method-assign]


def test_a_long_reconcile_beats_between_its_parts_and_a_stop_asked_meanwhile_queues_nothing(
    harness, primary, mirror, logs
) -> None:
    """A rescan whose listings each take longer than the heartbeat period (a big tree, a busy host) pings
    when it starts and after each listing; a stop asked while the mirror is listed ends the pass before
    it prunes or queues anything."""
    h = harness(daemon={"heartbeat_seconds": 0.1})
    h.daemon.start()
    save_checkpoint(primary / REL, 7)
    during_mirror: list[Callable[[], None]] = []
    slow_listings(h, 0.5, during_mirror)
    h.clock.advance(600)
    before = h.journal.count("WATCHDOG=1")
    h.daemon.tick(wait=False)
    assert h.journal.count("WATCHDOG=1") - before == 3  # due at the rescan, then after each listing
    assert len(events(logs, "reconcile.finished")) == 2
    wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the rescanned copy")

    later = "run/step_0008.pt"
    save_checkpoint(primary / later, 8)
    during_mirror.append(h.daemon._stop)  # SIGTERM, or the heartbeat finding the mirror's lock lost
    h.clock.advance(600)
    h.daemon.tick(wait=False)
    assert h.daemon.signals.stop_requests == 1
    assert h.daemon.queue.depth() == 0 and [e["path"] for e in events(logs, "copy.started")] == [REL]
    assert len(events(logs, "reconcile.finished")) == 2  # the stopped pass ends unfinished
    assert not (mirror / later).exists()


@pytest.mark.parametrize("prune", [False, True], ids=["rollbacks_read_again", "rollbacks_from_the_plan"])
def test_a_rollback_warning_splits_lying_clocks_exactly_where_retention_does(
    harness, primary, logs, prune: bool
) -> None:
    """Steps 1 and 3 written, then 2 again, stamped exactly at the future-skew line in run `at` and one
    nanosecond past it in run `past`. Whether the rollbacks are read from the retention plan (prune on) or
    read again from the primary listing (prune off), the line is PruneRequest.lie_after_ns at the daemon's
    clock: run `at` rolled back, run `past` has a lying clock that says nothing about order."""
    h = harness(prune={"enabled": prune})
    config = h.daemon.reconciler.config
    line = PruneRequest(config.prune, config.step_regex, h.clock.wall).lie_after_ns
    assert line == int(line)  # the two stamps below straddle it exactly
    for run, step_2 in (("at", int(line)), ("past", int(line) + 1)):
        for step in (1, 3):
            save_checkpoint(primary / run / f"step_{step:04d}.pt", step)
        save_checkpoint(primary / run / "step_0002.pt", 2, mtime_ns=step_2)
        assert (primary / run / "step_0002.pt").stat().st_mtime_ns == step_2
    h.daemon.start()
    assert [(e["run"], e["old_step"], e["new_step"]) for e in events(logs, "run.rollback_detected")] == [("at", 3, 2)]


def test_a_stop_asked_while_the_primary_is_listed_does_not_list_the_mirror(harness, primary, logs) -> None:
    """A rescan that is stopping neither lists the mirror nor plans: the stop is not held up by a listing."""
    save_checkpoint(primary / REL, 7)
    h = harness()
    h.daemon.start()
    wait_for(lambda: h.daemon.ledger.copied == 1, 60, "the copy")
    real_primary, real_mirror = h.daemon.primary.snapshot, h.daemon.mirror.snapshot
    mirror_listings: list[str] = []

    def primary_snapshot(*args: Any, **kwargs: Any) -> Any:
        h.daemon._stop()  # SIGTERM while the primary is listed
        return real_primary(*args, **kwargs)

    def mirror_snapshot(*args: Any, **kwargs: Any) -> Any:
        mirror_listings.append("listed")
        return real_mirror(*args, **kwargs)

    h.daemon.primary.snapshot = primary_snapshot  # type: ignore[method-assign]
    h.daemon.mirror.snapshot = mirror_snapshot  # type: ignore[method-assign]
    h.clock.advance(600)
    h.daemon.tick(wait=False)
    assert mirror_listings == [] and len(events(logs, "reconcile.finished")) == 1


def test_per_path_memory_is_dropped_when_the_path_is_gone(harness, primary, mirror) -> None:
    """A trainer cycling through new names (each written in place, settled, copied, then rotated away):
    the settle tracker and the ledger keep no record of a name no longer on the primary, so the
    daemon's per-path state stays bounded however many names it has seen."""
    h = harness(copy={"settle_seconds": 5})
    h.daemon.start()
    sizes = []
    for i in range(12):
        src = save_checkpoint(primary / "run" / f"step_{i}.pt", i)
        h.clock.advance(600)
        h.daemon.tick(wait=False)  # first seen: settling
        h.clock.advance(600)
        h.daemon.tick(wait=False)  # settled: copied
        wait_for(lambda i=i: h.daemon.ledger.copied == i + 1, 60, f"the copy of step {i}")
        src.unlink()  # rotated away
        tracker = h.daemon.settle
        sizes.append(len(tracker._seen) + len(tracker._committed) + len(h.daemon.ledger._recopies))
    assert (mirror / "run" / "step_11.pt").exists()
    assert max(sizes) <= 2, sizes  # the newest name (and the one rotated away since the last listing)


def test_a_copy_waiting_for_its_commit_keeps_the_drill_waiting_then_its_unit_is_drilled(
    harness, primary, logs, monkeypatch
) -> None:
    """A copy staged and waiting for its commit has its seq (ManifestEntry.seq) but no record yet: a turn then is not
    idle, so the drill does not judge the runs without it (nor set them aside until the manifest's seq moves, which
    its record landing does not do); once it is recorded the next turn drills its unit."""
    committing, release = threading.Event(), threading.Event()
    commit = Engine.commit

    def held(engine: Engine, batch: Any) -> Any:
        committing.set()
        release.wait(120)
        return commit(engine, batch)

    monkeypatch.setattr(Engine, "commit", held)
    h = harness(drill={"interval_hours": 24})
    h.daemon.start()
    save_checkpoint(primary / REL, 7)
    h.hint(REL)
    h.daemon.tick(wait=False)
    assert committing.wait(60), "the copy staged"
    h.daemon.tick(wait=False)
    release.set()
    wait_for(lambda: not h.daemon.queue.paths(), 60, "the copy recorded")
    assert REL in h.daemon.manifest.entries
    h.daemon.tick(wait=False)
    wait_for(lambda: events(logs, "drill.passed"), 120, "the unit drilled")


def test_pruning_after_copies_plans_from_the_last_listing_and_a_copy_deleted_behind_its_back_breaks_nothing(
    harness, primary, mirror, logs
) -> None:
    """keep_last 2, on hints alone: each new step is copied and the oldest copy pruned from the mirror as the first
    reconcile listed it plus the daemon's own copies and deletions since, with no listing of the mirror per copy.
    A copy the operator deleted meanwhile is found gone by the pass that meant to delete it (nothing to do, nothing
    broken); the next pass lists the mirror again and retention goes on. A copy of the window the operator deleted
    is found before anything is deleted on its strength: the pass lists the mirror and, as a fresh listing says,
    keeps the older step until that copy is made again."""
    h = harness(prune={"enabled": True, "keep_last": 2, "min_age_seconds": 0})
    listings: list[int] = []
    real = h.daemon.mirror.snapshot

    def counted(*args: Any, **kwargs: Any) -> Any:
        listings.append(1)
        return real(*args, **kwargs)

    h.daemon.mirror.snapshot = counted  # type: ignore[method-assign]
    h.daemon.start()

    def step(n: int) -> str:
        return f"run/step_{n:04d}.pt"

    def mirrored() -> list[str]:
        return sorted(p.relative_to(mirror).as_posix() for p in (mirror / "run").glob("*.pt"))

    def new_step(n: int, kept: list[int]) -> None:
        save_checkpoint(primary / step(n), n)
        h.hint(step(n))

        def done() -> bool:
            h.daemon.tick(wait=False)
            return mirrored() == [step(k) for k in kept] and not h.daemon.inbox.prune_due

        wait_for(done, 60, f"step {n} copied and the mirror pruned to {kept}")

    for n in (1, 2, 3):
        new_step(n, list(range(max(1, n - 1), n + 1)))
    assert len(listings) == 1, "the mirror was listed again after copies"  # (by the first reconcile only)
    (mirror / step(2)).unlink()  # the operator, behind the daemon's back: the copy retention deletes next
    new_step(4, [3, 4])
    assert [e["path"] for e in events(logs, "prune.skipped") if e["reason"] == "vanished"] == [step(2)]
    assert len(listings) == 1
    new_step(5, [4, 5])  # from a new listing: the last one did not match the mirror
    new_step(6, [5, 6])
    assert len(listings) == 2
    # (the record of the copy the operator deleted is left as a pass finding it gone leaves it)
    assert set(h.daemon.manifest.entries) - {step(2)} == {step(5), step(6)}
    (mirror / step(6)).unlink()  # behind the daemon's back again: a copy that retires the older steps
    new_step(7, [5, 7])  # step 6 is not verified any more: step 5 stays, as a fresh listing says
    assert len(listings) == 3 and events(logs, "prune.relisting")[-1]["path"] == step(6)
