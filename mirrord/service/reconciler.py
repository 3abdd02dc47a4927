"""The daemon's side of planning: list both volumes (or stat the files watch hints name), plan, and
hand the plan to the queue, the ledger and retention. Snapshots are the truth; hints only make it sooner."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from itertools import filterfalse
from posixpath import dirname
from typing import TypeVar

from mirrord.config import Config
from mirrord.core.branches import lying_after_ns, run_rollbacks
from mirrord.core.jobs import CopyJob
from mirrord.core.layouts import Layout
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.observe import Observations
from mirrord.core.plan import SettleTracker, why_copy
from mirrord.core.reconcile import Facts, View, reconcile
from mirrord.core.retention import MIRROR, PRIMARY, Deletion, PrunePlan
from mirrord.core.units import group_units, naming_warnings, unit_identity, unit_of
from mirrord.core.vocabulary import Veto
from mirrord.errors import MirrordError, UnsafePathError
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.service.completeness import judge, sharing_for
from mirrord.service.inbox import Inbox
from mirrord.service.jobqueue import JobQueue
from mirrord.service.ledger import VERIFY_FAILURES, Ledger
from mirrord.service.refusals import IDENTITY, LISTING, Refusals
from mirrord.service.settings import Settings
from mirrord.store.aliases import alias_links, mirror_alias_links
from mirrord.store.atomic import TEMP_SUFFIX
from mirrord.store.bulk import collection_paused
from mirrord.store.listing_child import PendingListing
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.volume import LocalMirror, LocalVolume

# One turn of the main loop does at most this much of a pass whose size is the burst's (the watch hints
# of thousands of checkpoints committed at once, a settle recheck of as many files) and leaves the rest
# to the next turns: the heartbeat (WATCHDOG=1, /healthz), a stop or a reload never wait longer than
# this for such a pass, however big the burst and however slowly each file is stat'ed on a busy host.
TURN_SECONDS = 0.1

T = TypeVar("T")


def one_turn(clock: Callable[[], float], pending: Sized, pop: Callable[[], T], *,
             counts: Callable[[T], bool] = lambda _: True, go_on: Callable[[], bool] = lambda: True) -> Iterator[T]:
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


class Reconciler:
    """Full reconciles, hint handling, settle rechecks and prune passes, all run by the main loop."""

    def __init__(self, *, settings: Callable[[], Settings], primary: LocalVolume, mirror: Mirror,
                 manifest: Manifest, queue: JobQueue, ledger: Ledger, refusals: Refusals, inbox: Inbox,
                 settle: SettleTracker, observations: Observations, metrics: Metrics, heartbeat: Callable[[], None],
                 stopping: Callable[[], bool],
                 wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.primary, self.mirror, self.manifest = settings, primary, mirror, manifest
        self.queue, self.ledger, self.refusals, self.inbox = queue, ledger, refusals, inbox
        self.settle, self.observations, self.metrics = settle, observations, metrics
        self.heartbeat, self.stopping = heartbeat, stopping
        self.wall, self.monotonic = wall, monotonic
        self.unsettled: set[str] = set()
        self._next_rescan = self._next_settle = 0.0
        # A settle recheck round in progress: the rules it was taken under, and what it has still to look
        # at (file paths, or folder units with rules.folders); None between rounds.
        self._recheck: tuple[Layout, list[str]] | None = None
        self._rollbacks_logged: set[str] = set()
        self._naming_logged: set[tuple[str, str]] = set()  # (kind, pattern): once per daemon run
        # The last complete listings, kept current (published copies, hinted files, deletions): a prune
        # pass after a burst of copies plans from them instead of listing both trees again.
        self._in_hand: tuple[Snapshot, Snapshot] | None = None
        # The last full primary listing judged for naming warnings, and by which rules: a file already in
        # it was judged then, so a rescan judges only the files new since (each rescan would otherwise
        # group every file of the tree into units again, to warn about nothing).
        self._named: tuple[Layout, Snapshot] | None = None
        # The last retention plan of a complete listing: the next one reuses its decisions for the runs
        # unchanged since (a rescan of a tree at rest plans again only what moved).
        self._child_problem: str | None = None  # why the mirror's last listing was not made by a child
        self.log = get_logger()

    @property
    def config(self) -> Config:
        """The config in force now."""
        return self.settings().config

    # -- scheduling -------------------------------------------------------------------------------
    def start(self) -> None:
        """The first reconcile; the next one is due a rescan interval later."""
        self.reconcile()
        now, cfg = self.monotonic(), self.config
        self._next_rescan = now + cfg.watch.rescan_interval_seconds
        self._next_settle = now + min(0.5, cfg.copy.settle_seconds or 0.5)

    def _settling(self) -> bool:
        return bool(self.unsettled or self.ledger.invalid_paths())

    def next_deadline(self) -> float:
        """When there is work even if nothing wakes the loop: the rescan, a settle recheck (at once while a
        round is in progress: its next turn), a prune pass."""
        deadlines = [self._next_rescan]
        if self._settling():
            deadlines.append(self._next_settle)
        if self.inbox.prune_at is not None:
            deadlines.append(self.inbox.prune_at)
        return min(deadlines)

    def work(self) -> None:
        """Do what is due: hints (or a full reconcile when asked, or at the rescan interval), settle
        rechecks, a prune pass after copies or when an observation matures. Hints and rechecks take one
        turn each at most (TURN_SECONDS; the loop comes back at once for the rest), and the heartbeat
        is given its chance between the parts."""
        cfg, now = self.config, self.monotonic()
        if self.drain_hints() or self.inbox.rescan_asked or now >= self._next_rescan:
            self.heartbeat()
            self.inbox.rescan_asked = False
            self.reconcile()
            self._next_rescan = self.monotonic() + cfg.watch.rescan_interval_seconds
        if self._settling() and now >= self._next_settle:
            self.heartbeat()
            if self.recheck_unsettled():  # else the round goes on next turn (_next_settle stays due)
                self._next_settle = self.monotonic() + min(0.5, cfg.copy.settle_seconds or 0.5)
        if self.inbox.prune_at is not None and now >= self.inbox.prune_at:
            self.inbox.prune_at, self.inbox.prune_due = None, True
        if self.inbox.prune_due:
            self.heartbeat()
            self.inbox.prune_due = False
            self.prune()

    # -- reconcile and hints ------------------------------------------------------------------------
    def reconcile(self) -> None:
        """List both volumes, prune, and queue what the mirror lacks (nothing while the mirror is refused)."""
        # A rescan builds records for every file of both sides (listings, plans, observations), none in a
        # cycle: without the pause the cycle collector walks the whole heap twice per rescan, more than
        # half of a rescan's CPU time at 100,000 files.
        with collection_paused():
            self._reconcile()

    def _reconcile(self) -> None:
        started = self.monotonic()
        problem = self.mirror.identity_problem()
        self.refusals.refuse(IDENTITY, problem)
        # The manifest is read before the mirror is listed: a copy recorded in it was published before
        # it was recorded, so the listing cannot miss it (a copy published meanwhile is rechecked).
        # A prefix several nodes share: what the others recorded is taken in first (retention plans
        # from the merged manifest).
        if not problem:
            try:
                self.manifest.refresh()
            except MirrordError as exc:  # planned from what we know: a stale view only keeps more
                self.log.warning("manifest.refresh_failed", path=exc.path, cause=exc.cause)
        entries = self.manifest.entries
        # A big mirror is listed by a child process while this one lists the primary (two CPUs).
        pending = None if problem else self.mirror.start_snapshot(self.config.patterns, self.config.rules,
                                                                  len(entries), self.config.watch.parallel_listing)
        try:
            psnap = self.primary.snapshot(self.config.patterns, self.config.rules)
            for msg in psnap.errors:
                self.log.error("scan.error", cause=msg)
            links = alias_links(psnap.skipped, self.config.rules)
            for rel, why in psnap.skipped:
                if rel not in links:  # an alias symlink (last.ckpt) is mirrored as a link, not warned about
                    self.log.warning("scan.skipped", path=rel, why=why, volume="primary")
            # The heartbeat between the parts of a pass that takes seconds on a big tree or a busy host: each
            # part is planned after it from what the beat found (a refusal is honoured below).
            self.heartbeat()
            if self.stopping():  # asked meanwhile (or the lock is lost): the mirror's listing is not wanted
                return
            msnap = None if pending is None else pending.result()
        finally:
            if pending is not None:
                pending.abandon()  # (a no-op once its result was taken)
        if pending is not None and pending.problem != self._child_problem:  # said once, not every rescan
            self._child_problem = pending.problem
            if pending.problem is not None:
                self.log.warning("scan.child_failed", cause=pending.problem, volume="mirror",
                                 path=self.mirror.describe(), listed="in the daemon's process instead")
        # The listings in hand are superseded (the volumes kept what their next listings reuse): not kept
        # alive through the planning of the new ones.
        self._in_hand = None
        for msg in msnap.errors if msnap is not None else ():
            self.log.error("scan.error", cause=msg)
        self.heartbeat()
        view = self._view(psnap, msnap, entries, problem)
        self.heartbeat()
        if self.stopping():  # asked meanwhile (or the beat found the mirror's lock lost): no prune, no queue
            return
        if msnap is not None:
            self.refusals.refuse(LISTING, view.refused)
        self._in_hand = (psnap, msnap) if msnap is not None and not self.refusals.blocked else None
        if self.refusals.blocked:
            # Nothing is queued while the mirror is refused, yet it falls behind: keep lag honest.
            self.ledger.behind(view.behind, True, entries)
            self.log.debug("reconcile.refused", cause=self.refusals.blocked)
            return
        self._log_rollbacks(psnap, view.prune)
        self._warn_naming(psnap)
        # Prune first, from the same view that tells the copy planner which old steps retention retired.
        self.prune(view.prune)
        # The plan is done with (the pruner keeps its retirement): its per-file
        # grouping of the tree is not kept through the queueing, nor is this copy of the manifest's entries.
        view, entries = dataclasses.replace(view, prune=PrunePlan()), {}
        queued = self._enqueue(view, psnap)
        self._link_aliases(links)
        self.metrics.reconcile_duration.set(self.monotonic() - started)
        self.log.info("reconcile.finished", primary_files=len(psnap.files),
                      mirror_files=len(msnap.files) if msnap else 0,
                      mirror_listed_by=_listed_by(pending),
                      queued=queued, unsettled=len(self.unsettled),
                      seconds=round(self.monotonic() - started, 3))

    def _view(self, psnap: Snapshot, msnap: Snapshot | None, entries: Mapping[str, ManifestEntry],
              problem: str | None = None, partial: bool = False) -> View:
        """reconcile() with what this daemon knows; `partial`: the files watch hints named, judged by the
        retention of the last complete listing."""
        cfg, pruner = self.config, self.settings().pruner
        if partial:
            facts, retired_by = Facts(invalid=self.ledger.invalid_files()), (pruner and pruner.last_plan) or PrunePlan()
        else:
            observed = self.observations.observe(psnap, msnap) if msnap is not None and pruner else None
            facts = Facts(mirror_problem=problem, observed=observed, invalid=self.ledger.invalid_files(),
                          mirror_is_mount=self.mirror.is_mountpoint(),
                          roots=pruner.roots if pruner else None,
                          pointed=pruner.pointed() if pruner else frozenset())
            retired_by = None
        settled = self.settle.at(self.monotonic())
        sharing = sharing_for(cfg, self.manifest, self.primary, settled)
        complete = judge(self.primary, cfg.rules, settled, tell=True)
        view = reconcile(psnap, msnap, entries, cfg, self.wall(), frozenset(self.queue.paths()), settled,
                         facts=facts, retired_by=retired_by, is_complete=complete, sharing=sharing)
        return view

    def _link_aliases(self, links: list[str]) -> None:
        """Alias symlinks (last.ckpt) recreated on the mirror once the step they name is recorded."""
        if not links or not isinstance(self.mirror, LocalMirror):
            return
        try:
            made = mirror_alias_links(self.config.primary, self.config.mirror, links, self.manifest.entries)
        except OSError as exc:
            self.log.error("alias.link_failed", cause=exc.strerror or str(exc))
            return
        for rel, target in made:
            self.log.info("alias.linked", path=rel, target=target)

    def _warn_naming(self, psnap: Snapshot) -> None:
        """Once per file name pattern per run (not per rescan): checkpoints with no step in their name
        (retention never prunes them: usually the wrong `layout` or step_pattern), and files that look
        like checkpoints but the layout does not select (never mirrored)."""
        rules = self.config.rules
        judged = psnap
        if self._named is not None and self._named[0] == rules:
            # The files new since, filtered in C: no Python loop per file and no set of every path at once
            # (naming_warnings sorts what it judges, so the order they come in is no matter).
            files, new = psnap.files, filterfalse(self._named[1].files.__contains__, psnap.files)
            judged = dataclasses.replace(psnap, files={rel: files[rel] for rel in new})
        self._named = (rules, psnap)
        for warning in naming_warnings(judged, rules):
            if (warning.kind, warning.pattern) in self._naming_logged:
                continue
            self._naming_logged.add((warning.kind, warning.pattern))
            event = "checkpoint.no_step" if warning.kind == "no_step" else "checkpoint.not_selected"
            self.log.warning(event, path=warning.path, pattern=warning.pattern, layout=rules.name,
                             step_pattern=rules.step_pattern, why=warning.message,
                             hint="mirrord check-config prints the layout's rules and these warnings")

    def _log_rollbacks(self, psnap: Snapshot, plan: PrunePlan) -> None:
        """Once per run: the trainer went back to a lower step (its new checkpoints are mirrored). Read from
        the retention plan when it worked them out (it has grouped every file by run and step already)."""
        found = plan.primary_rollbacks
        if found is None:
            lie = lying_after_ns(self.wall(), self.config.prune.future_skew_seconds)  # as PruneRequest's
            found = run_rollbacks(psnap.files.values(), self.config.step_regex, lie)
        for run, rollbacks in found.items():
            if run not in self._rollbacks_logged:
                self._rollbacks_logged.add(run)
                old, new = rollbacks[-1]
                self.log.warning("run.rollback_detected", run=run or ".", old_step=old, new_step=new,
                                 rollbacks=len(rollbacks))

    def _enqueue(self, view: View, psnap: Snapshot, partial: bool = False, scope: set[str] | None = None) -> int:
        if self.refusals.blocked:
            return 0  # every enqueue path honours a refusal (the settle recheck, hints, reconciles)
        queued = 0
        behind, jobs = [], []
        for job in view.jobs:  # without the steps retention retired (prune.primary = false keeps them)
            if self._judged_invalid(job, psnap):
                continue  # judged invalid as it is now; read again once it changes and settles again
            if job.why in VERIFY_FAILURES and not job.members and not self._still_damaged(job, psnap.files[job.rel]):
                continue  # published and recorded while we listed: not damage, not a job
            behind.append(job)
            if self.ledger.copy_loops(job):
                continue
            state = psnap.files.get(job.rel)
            jobs.append(job if state is None or not self.settle.committed(state) else
                        dataclasses.replace(job, committed=True))
        if partial:  # what this view covered: the files listed, or the units judged again
            covered = set(psnap.files) if scope is None else scope
            self.unsettled.difference_update(covered - set(view.unsettled))
            self.unsettled.update(view.unsettled)
        else:
            self.unsettled = set(view.unsettled)
            if psnap.complete:
                rules = self.config.rules
                self.ledger.keep_invalid(group_units(psnap.files.values(), rules) if rules.folders else psnap.files)
                self.settle.retain(psnap.files)
        self.ledger.behind(behind, not partial, self.manifest.entries)
        for job in jobs:
            if not self.queue.put(job):
                continue
            queued += 1
            if job.why in VERIFY_FAILURES:
                self.ledger.damaged(job)
        return queued

    def _judged_invalid(self, job: CopyJob, psnap: Snapshot) -> bool:
        """The job's source (a file, or every file of a folder unit) is exactly what failed its validator."""
        if job.members:
            states = [psnap.files[rel] for rel in job.members if rel in psnap.files]
            return len(states) == len(job.members) and self.ledger.judged_invalid(job.rel, unit_identity(states))
        src = psnap.files.get(job.rel)
        return src is not None and self.ledger.judged_invalid(job.rel, src.identity)

    def _still_damaged(self, job: CopyJob, src: FileState) -> bool:
        """Recheck a 'missing' or 'mismatched' mirror copy against a fresh stat and manifest record: a
        copy published between the listing and the plan is not damage (no false verify failures)."""
        try:
            fresh = self.mirror.stat(job.rel)
        except (OSError, UnsafePathError):
            return True
        return why_copy(src, self.manifest.get(job.rel), fresh) in VERIFY_FAILURES

    def drain_hints(self) -> bool:
        """Handle queued watcher hints for one turn (TURN_SECONDS, at least one hint; the rest stay queued
        for the next turns); returns True when a full rescan was asked for. With folder units a hint names
        the unit it lies in, and only the units named are listed and judged again."""
        rules = self.config.rules
        files: dict[str, FileState] = {}
        units: set[str] = set()
        rescan = False
        hints = self.inbox.hints
        for hint in one_turn(self.monotonic, hints, hints.popleft):
            unit = unit_of(hint.rel, rules) if hint.rel and rules.folders else None
            if hint.rescan and unit is None:
                rescan = True  # an overflow, or a folder moved in that is no unit (a whole run folder)
                continue
            if unit is not None:
                units.add(unit)
                if not hint.committed:
                    continue  # a folder unit is judged from a listing of it: no stat of the file needed
            try:
                state = self.primary.stat(hint.rel)
            except (OSError, UnsafePathError):
                continue
            if state is None or not state.is_regular:
                continue
            if hint.committed:
                self.settle.mark_committed(state)
            if unit is None:
                files[hint.rel] = state
        if rescan:
            self.log.warning("watch.rescan", why="event queue overflow or directory move")
            return True
        if self.refusals.blocked:
            return False
        if files and any(rules.is_alias(rel) for rel in files):
            return True  # an alias (last.ckpt) waits for the newest step of its run: a full listing shows it
        if units:
            self._refresh_units(units)
        if files and not rules.folders:
            self._enqueue_paths(files)
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
                run = dirname(rel)
                newest = max(self.primary.unit_folders(run, rules), default=None,
                             key=lambda u: -1 if (step := rules.step_of(u.rsplit("/", 1)[-1])) is None else step)
                if newest is not None:
                    scope.add(newest)
        folders = tuple(rel + "/" for rel in scope if not rules.is_extra_name(rel.rsplit("/", 1)[-1]))
        files: dict[str, FileState] = {}
        errors: list[str] = []
        for rel in scope:
            if rel + "/" in folders:
                listed = self.primary.snapshot_unit(rel, rules)
                files.update(listed.files)
                errors.extend(listed.errors)
                continue
            try:
                state = self.primary.stat(rel)
            except (OSError, UnsafePathError):
                state = None
            if state is not None and state.is_regular:
                files[rel] = state
        for msg in errors:
            self.log.error("scan.error", cause=msg)
        entries = self.manifest.entries
        mirror_files: dict[str, FileState] = {}
        for rel in set(files) | {e for e in entries if e in scope or e.startswith(folders)}:
            try:
                state = self.mirror.stat(rel)
            except (OSError, UnsafePathError):
                state = None
            if state is not None:
                mirror_files[rel] = state
        psnap = Snapshot(files, errors=tuple(errors))
        if self._in_hand is not None:
            held, msnap = self._in_hand
            kept = {rel: s for rel, s in held.files.items() if not (rel in scope or rel.startswith(folders))}
            self._in_hand = (dataclasses.replace(held, files={**kept, **files}), msnap)
        self._enqueue(self._view(psnap, Snapshot(mirror_files), entries, partial=True), psnap, partial=True,
                      scope=scope)

    def _enqueue_paths(self, files: dict[str, FileState]) -> None:
        mirror_files: dict[str, FileState] = {}
        for rel in files:
            state = self.mirror.stat(rel)
            if state is not None:
                mirror_files[rel] = state
        psnap = Snapshot(files)
        if self._in_hand is not None:
            held, msnap = self._in_hand
            self._in_hand = (dataclasses.replace(held, files={**held.files, **files}), msnap)
        self._enqueue(self._view(psnap, Snapshot(mirror_files), self.manifest.entries, partial=True), psnap,
                      partial=True)

    def recheck_unsettled(self) -> bool:
        """Stat the files still settling or invalid again; queue those that are ready now. One round looks
        at each of them once, one turn (TURN_SECONDS, at least one file or unit) per call: True when the
        round is done, False when the next call goes on with it."""
        rules = self.config.rules
        if self._recheck is None or self._recheck[0] != rules:  # a new round (or new rules: start over)
            self._recheck = (rules, self._recheck_round(rules))
        pending = self._recheck[1]
        if rules.folders:  # each unit still settling judged again from a listing of it alone (a unit
            # judged invalid is remembered by its files' identities: judged again when an event names it)
            settling = {u for rel in self.unsettled if (u := unit_of(rel, rules))}
            # (a unit no longer settling settled, or was judged on a hint, since the round began)
            for unit in one_turn(self.monotonic, pending, pending.pop, counts=settling.__contains__,
                                 go_on=lambda: not self.refusals.blocked):
                self._refresh_units({unit})
            return self._recheck_done()
        invalid = self.ledger.invalid_paths()
        files: dict[str, FileState] = {}
        # (a file neither settling nor invalid was queued or is gone since the round began: a hint, a rescan)
        for rel in one_turn(self.monotonic, pending, pending.pop,
                            counts=lambda rel: rel in self.unsettled or rel in invalid):
            try:
                state = self.primary.stat(rel)
            except (OSError, UnsafePathError):
                state = None
            if state is None or not state.is_regular:
                self.unsettled.discard(rel)
                self.ledger.forget_invalid(rel)
                self.settle.forget(rel)
            else:
                files[rel] = state
        if files:
            self._enqueue_paths(files)
        return self._recheck_done()

    def _recheck_round(self, rules: Layout) -> list[str]:
        """What a new settle recheck round looks at: the folder units still settling, or the files still
        settling or invalid (an alias among them asks for a full listing instead: it is judged from one)."""
        if rules.folders:
            return sorted({u for rel in self.unsettled if (u := unit_of(rel, rules))}, reverse=True)
        if self.unsettled and any(rules.is_alias(rel) for rel in self.unsettled):
            self.inbox.rescan_asked = True
            self.inbox.wake()
        return sorted((rel for rel in self.unsettled | self.ledger.invalid_paths() if not rules.is_alias(rel)),
                      reverse=True)

    def _recheck_done(self) -> bool:
        """Whether the round in progress has looked at everything (and is over)."""
        if self._recheck is not None and self._recheck[1] and not self.refusals.blocked:
            return False
        self._recheck = None
        return True

    def prune(self, plan: PrunePlan | None = None) -> None:
        """One retention pass: from `plan` (a reconcile's), else from the snapshots in hand (else fresh
        listings); a stop request ends it between deletions."""
        pruner = self.settings().pruner
        if pruner is None or self.refusals.blocked:
            return
        if plan is None and self._in_hand is not None:
            with collection_paused():  # (see reconcile)
                view = self._view(*self._fold(), self.manifest.entries)
            self.refusals.refuse(LISTING, view.refused)
            if self.refusals.blocked:
                return
            plan = view.prune
        try:
            report = pruner.run_cycle(plan=plan, keep_going=self._between_deletions)
        except MirrordError as exc:
            self.log.error("prune.failed", reason=exc.reason, path=exc.path, cause=exc.cause)
            return
        self._forget(report.deleted)
        if Veto.RECENTLY_SEEN in report.skips_by_reason():
            # Observations mature min_age_seconds after they start: look again then (the observation
            # clock is monotonic, so this never hastens a deletion; a later rescan also covers it).
            due = self.monotonic() + self.config.prune.min_age_seconds
            self.inbox.prune_when(due)


    def _fold(self) -> tuple[Snapshot, Snapshot]:
        """The snapshots in hand with the copies published since folded in (one stat per file)."""
        assert self._in_hand is not None
        psnap, msnap = self._in_hand
        files, partials = dict(msnap.files), dict(msnap.partials)
        while self.ledger.published:
            for rel in self.ledger.published.popleft().paths:
                partials.pop(rel + TEMP_SUFFIX, None)
                try:
                    state = self.mirror.stat(rel)
                except (OSError, UnsafePathError):
                    state = None
                if state is None:
                    files.pop(rel, None)
                else:
                    files[rel] = state
        self._in_hand = (psnap, dataclasses.replace(msnap, files=files, partials=partials))
        return self._in_hand

    def _forget(self, deleted: list[Deletion]) -> None:
        """Drop what retention deleted from the snapshots in hand."""
        if self._in_hand is None or not deleted:
            return
        gone = {(d.volume, d.rel) for d in deleted}

        def kept(volume: str, states: dict[str, FileState]) -> dict[str, FileState]:
            return {rel: s for rel, s in states.items() if (volume, rel) not in gone}

        psnap, msnap = self._in_hand
        self._in_hand = (
            dataclasses.replace(psnap, files=kept(PRIMARY, psnap.files)),
            dataclasses.replace(msnap, files=kept(MIRROR, msnap.files), partials=kept(MIRROR, msnap.partials),
                                staging=kept(MIRROR, msnap.staging)),
        )

    def _between_deletions(self) -> bool:
        """A long prune pass keeps the daemon alive: new checkpoints are queued (workers copy meanwhile),
        the heartbeat (WATCHDOG=1, /healthz) goes on, and a stop request ends the pass."""
        if self.inbox.hints and self.drain_hints():
            self.inbox.rescan_asked = True
        self.heartbeat()
        return not self.stopping()


def _listed_by(pending: PendingListing | None) -> str:
    """Who listed the mirror in a reconcile, for its `reconcile.finished` event."""
    if pending is None:
        return "nobody (the mirror was refused)"
    return "a child process" if pending.in_child else "the daemon"
