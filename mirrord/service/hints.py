"""Between full reconciles: the files watch events name, and the files still settling or invalid, are
stat'ed (or, for folder units, listed) and planned alone, a turn of the main loop at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from posixpath import dirname
from typing import TypeVar

from mirrord.core.model import FileState, Snapshot
from mirrord.core.units import unit_of
from mirrord.layouts import Layout
from mirrord.service.enqueue import Enqueuer
from mirrord.store.volume import stat_safely

# One turn of the main loop does at most this much of a pass whose size is the burst's (the watch hints
# of thousands of checkpoints committed at once, a settle recheck of as many files) and leaves the rest
# to the next turns: the heartbeat (WATCHDOG=1, /healthz), a stop or a reload never wait longer than
# this for such a pass, however big the burst and however slowly each file is stat'ed on a busy host.
TURN_SECONDS = 0.1

T = TypeVar("T")


def one_turn(
    clock: Callable[[], float],
    pending: Sized,
    pop: Callable[[], T],
    *,
    counts: Callable[[T], bool] = lambda _: True,
    go_on: Callable[[], bool] = lambda: True,
) -> Iterator[T]:
    """Take items from `pending` (with `pop`) for one turn: at least one item that `counts`, then more only
    while TURN_SECONDS on `clock` have not passed. An item that does not count (nothing left to do for it)
    is dropped without spending the turn's guaranteed first place, and `go_on` turning false ends the turn
    before the next item is taken. What is left stays in `pending` for the next turns."""
    ends, worked = clock() + TURN_SECONDS, False
    while pending and go_on() and (not worked or clock() < ends):
        item = pop()
        if counts(item):
            worked = True
            yield item


class Hints(Enqueuer):
    """The enqueuer of the main loop, which also plans watch hints and settle rechecks from the files they
    name."""

    # A settle recheck round in progress: the rules it was taken under, and what it has still to look at
    # (file paths, or folder units with rules.folders); None between rounds.
    _recheck: tuple[Layout, list[str]] | None = None

    def drain_hints(self) -> bool:
        """Handle queued watcher hints for one turn (TURN_SECONDS, at least one hint; the rest stay queued
        for the next turns); returns True when a full rescan was asked for. With folder units a hint names
        the unit it lies in, and only the units named are listed and judged again."""
        rules = self.config.rules
        files: dict[str, FileState] = {}
        units: set[str] = set()
        rescan = False
        for hint in one_turn(self.monotonic, self.inbox.hints, self.inbox.next_hint):
            unit = unit_of(hint.rel, rules) if hint.rel and rules.folders else None
            if unit is not None:
                units.add(unit)  # a folder unit is judged from a listing of it (a rename gives it no shortcut)
            elif hint.rescan:
                rescan = True  # an overflow, or a folder moved in that is no unit (a whole run folder)
            elif (state := stat_safely(self.primary, hint.rel)) is not None and state.is_regular:
                if hint.committed:
                    self.settle.mark_committed(state)
                files[hint.rel] = state
        if rescan:
            self.log.warning("watch.rescan", why="event queue overflow or directory move")
            return True
        if self.refusals.blocked:
            self.refusals.missed = True
            return False
        if files and any(rules.is_alias(rel) for rel in files):
            return True  # an alias (last.ckpt) waits for the newest step of its run: a full listing shows it
        if units:
            self._refresh_units(units)
        if files and not rules.folders:
            self._enqueue_files(files)
        return False

    def _refresh_units(self, units: set[str]) -> None:
        """List the folder units `units` (and the tag or alias files among them) on both sides, judge them,
        and queue what is whole and not mirrored: a watch event's or a settle recheck's cost is the size
        of its unit, not of the tree. A tag file is planned against the newest folder of its run, so that
        folder is listed with it."""
        rules = self.config.rules
        scope = set(units)
        for rel in units:
            if rules.is_extra_name(rel.rsplit("/", 1)[-1]):
                newest = max(
                    self.primary.unit_folders(dirname(rel), rules),
                    default=None,
                    key=lambda u: -1 if (step := rules.step_of(u.rsplit("/", 1)[-1])) is None else step,
                )
                if newest is not None:
                    scope.add(newest)
        files: dict[str, FileState] = {}
        errors: list[str] = []
        for rel in scope:
            if not rules.is_extra_name(rel.rsplit("/", 1)[-1]):
                listed = self.primary.snapshot_unit(rel, rules)
                files.update(listed.files)
                errors.extend(listed.errors)
            elif (state := stat_safely(self.primary, rel)) is not None and state.is_regular:
                files[rel] = state
        for msg in errors:
            self.log.error("scan.error", cause=msg)
        self._enqueue_files(files, scope, tuple(errors))

    def _enqueue_files(
        self, files: dict[str, FileState], scope: set[str] | None = None, errors: tuple[str, ...] = ()
    ) -> None:
        """Plan `files` alone against the mirror's copies of them, and of what the manifest records of the
        units of `scope` (whose files these are)."""
        entries = self.manifest.entries
        folders = tuple(rel + "/" for rel in scope or ())
        # A file the manifest does not record is copied whatever the mirror holds under its name: not stat'ed (on
        # an object store a HEAD, and a LIST of NAME/ when no object has that name).
        named = (
            set(files) | {e for e in entries if e in scope or e.startswith(folders)}
            if scope
            else files.keys() & entries.keys()
        )
        mirror_files = {rel: state for rel in named if (state := stat_safely(self.mirror, rel)) is not None}
        psnap = Snapshot(files, errors=errors)
        view = self.view(psnap, Snapshot(mirror_files), entries, partial=True)
        self.enqueue(view, psnap, partial=True, scope=scope)

    def recheck_unsettled(self) -> bool:
        """Stat the files still settling or invalid again; queue those that are ready now. One round looks
        at each of them once, one turn (TURN_SECONDS, at least one file or unit) per call: True when the
        round is done, False when the next call goes on with it."""
        rules, unsettled = self.config.rules, self.unsettled
        if self._recheck is None or self._recheck[0] != rules:  # a new round (or new rules: start over)
            self._recheck = (rules, self._recheck_round(rules))
        pending = self._recheck[1]
        if rules.folders:  # each unit still settling judged again from a listing of it alone (a unit
            # judged invalid is remembered by its files' identities: judged again when an event names it)
            settling = {u for rel in unsettled if (u := unit_of(rel, rules))}
            # (a unit no longer settling settled, or was judged on a hint, since the round began)
            for unit in one_turn(
                self.monotonic,
                pending,
                pending.pop,
                counts=settling.__contains__,
                go_on=lambda: not self.refusals.blocked,
            ):
                self._refresh_units({unit})
        else:
            invalid = self.ledger.invalid_paths()
            files: dict[str, FileState] = {}
            # (a file neither settling nor invalid was queued or is gone since the round began: a hint, a rescan)
            for rel in one_turn(
                self.monotonic, pending, pending.pop, counts=lambda rel: rel in unsettled or rel in invalid
            ):
                state = stat_safely(self.primary, rel)
                if state is None or not state.is_regular:
                    unsettled.discard(rel)
                    self.ledger.forget_invalid(rel)
                    self.settle.forget(rel)
                else:
                    files[rel] = state
            if files:
                self._enqueue_files(files)
        if pending and not self.refusals.blocked:
            return False  # the round goes on next call
        self._recheck = None
        return True

    def _recheck_round(self, rules: Layout) -> list[str]:
        """What a new settle recheck round looks at: the folder units still settling, or the files still
        settling or invalid (an alias among them asks for a full listing instead: it is judged from one)."""
        unsettled = self.unsettled
        if rules.folders:
            return sorted({u for rel in unsettled if (u := unit_of(rel, rules))}, reverse=True)
        if unsettled and any(rules.is_alias(rel) for rel in unsettled):
            self.inbox.rescan_asked = True
            self.inbox.wake()
        return sorted((rel for rel in unsettled | self.ledger.invalid_paths() if not rules.is_alias(rel)), reverse=True)
