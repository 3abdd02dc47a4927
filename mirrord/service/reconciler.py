"""The daemon's side of planning: list both volumes (or stat the files watch hints name), plan, and
hand the plan to the queue, the ledger and retention. Snapshots are the truth; hints only make it sooner.
Each full reconcile plans afresh from two new listings: nothing is carried from one turn to the next but
the log-once records and what the ledger and the settle tracker hold, and the mirror's last listing, which the
prune passes between reconciles plan from (with this daemon's own changes since) instead of listing it again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from mirrord.config import Config
from mirrord.core.branches import lying_after_ns, run_rollbacks
from mirrord.core.model import VERSIONS, ManifestEntry, Snapshot
from mirrord.core.nodes import foreign
from mirrord.core.retention import FOLLOWED, KEEP_LAST, MIRROR, PrunePlan
from mirrord.core.units import naming_warnings
from mirrord.errors import MirrordError
from mirrord.obs.metrics import Metrics
from mirrord.service.hints import Hints
from mirrord.service.pruner import VANISHED, PruneReport
from mirrord.service.refusals import IDENTITY, LISTING
from mirrord.store.aliases import alias_links
from mirrord.vocabulary import Veto

# Past this many files to stat (records changed since the mirror was listed, copies a deletion rests on), a new
# listing is cheaper: on S3 a LIST (up to 1,000 keys) costs what about 12 HEADs cost, and takes one round trip.
RESTAT_MAX = 16


@dataclasses.dataclass(eq=False, kw_only=True)
class Reconciler(Hints):
    """Full reconciles, hint handling, settle rechecks and prune passes, all run by the main loop (planning
    and queueing: Enqueuer; watch hints and settle rechecks: Hints)."""

    metrics: Metrics
    heartbeat: Callable[[], None]
    stopping: Callable[[], bool]
    _next_rescan = _next_settle = 0.0  # (not fields: start() schedules them)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rollbacks_logged: set[str] = set()  # runs whose rollback was logged: once per daemon run
        self._naming_logged: set[tuple[str, str]] = set()  # (kind, pattern): once per daemon run
        # The mirror as a complete listing saw it and as this daemon changed it since, the manifest it matches (a
        # record changed since is a copy or a deletion made since) and the config it was listed under: what prune
        # passes plan from; None: list it.
        # Its maps are never changed once made (the observations keep them).
        self._listed: tuple[Snapshot, Mapping[str, ManifestEntry], Config] | None = None

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
        """When there is work even if nothing wakes the loop: the rescan (at once when a refusal that dropped
        work is over), a settle recheck (at once while a round is in progress: its next turn), a prune pass."""
        deadlines = [self._next_rescan]
        if self.refusals.missed and not self.refusals.blocked:
            deadlines.append(0.0)  # a refusal is over: at once
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
        missed = self.refusals.missed and not self.refusals.blocked  # (a refusal over: list what it dropped)
        if self.drain_hints() or self.inbox.rescan_asked or now >= self._next_rescan or missed:
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
        started = self.monotonic()
        self._listed = None  # (kept again below once this listing is complete and not refused)
        self.refusals.missed = False  # (set again below if a refusal still drops this listing's jobs)
        problem = self.mirror.identity_problem()
        self.refusals.refuse(IDENTITY, problem)
        # The manifest is read before the mirror is listed: a copy recorded in it was published before
        # it was recorded, so the listing cannot miss it (a copy published meanwhile is rechecked).
        # A prefix several nodes share: what the others recorded is taken in first (retention plans
        # from the merged manifest).
        if not problem:
            self._refresh_manifest()
        entries = self.manifest.entries
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
        msnap = None if problem else self.mirror.snapshot(self.config.patterns, self.config.rules)
        for msg in msnap.errors if msnap is not None else ():
            self.log.error("scan.error", cause=msg)
        self.heartbeat()
        view = self.view(psnap, msnap, entries, problem)
        self.heartbeat()
        if self.stopping():  # asked meanwhile (or the beat found the mirror's lock lost): no prune, no queue
            return
        if msnap is not None:
            self.refusals.refuse(LISTING, view.refused)
        if self.refusals.blocked:
            # Nothing is queued while the mirror is refused, yet it falls behind: keep lag honest.
            self.refusals.missed = True
            self.ledger.behind(view.behind, True, entries)
            self.log.debug("reconcile.refused", cause=self.refusals.blocked)
            return
        self._log_rollbacks(psnap, view.prune)
        self._warn_naming(psnap)
        self._keep(msnap, entries)
        # Prune first, from the same view that tells the copy planner which old steps retention retired.
        self.prune(view.prune)
        queued = self.enqueue(view, psnap)
        self._link_aliases(links)
        self.metrics.reconcile_duration.set(self.monotonic() - started)
        self.log.info(
            "reconcile.finished",
            primary_files=len(psnap.files),
            mirror_files=len(msnap.files) if msnap else 0,
            queued=queued,
            unsettled=len(self.unsettled),
            seconds=round(self.monotonic() - started, 3),
        )

    def _link_aliases(self, links: list[str]) -> None:
        """Alias symlinks (last.ckpt) recreated on the mirror once the step they name is recorded."""
        if not links:
            return
        try:
            made = self.mirror.link_aliases(self.config.primary, links, self.manifest.entries)
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
        for warning in naming_warnings(psnap, rules):
            if (warning.kind, warning.pattern) not in self._naming_logged:
                self._naming_logged.add((warning.kind, warning.pattern))
                self.log.warning(
                    f"checkpoint.{warning.kind}",
                    path=warning.path,
                    pattern=warning.pattern,
                    layout=rules.name,
                    step_pattern=rules.step_pattern,
                    why=warning.message,
                    hint="mirrord check-config prints the layout's rules and these warnings",
                )

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
                self.log.warning(
                    "run.rollback_detected", run=run or ".", old_step=old, new_step=new, rollbacks=len(rollbacks)
                )

    def prune(self, plan: PrunePlan | None = None) -> None:
        """One retention pass: from `plan` (a reconcile's), else from a fresh listing of the primary and the
        mirror as last listed plus this daemon's changes since (listed again, after the manifest took in what
        other nodes recorded, when that view is not to be trusted); a stop request ends it between deletions."""
        pruner = self.settings().pruner
        if pruner is None or self.refusals.blocked:
            self._listed = None  # (a refused mirror may not be what was listed: listed again after it)
            return
        reconciled, psnap, msnap = plan is not None, None, None
        try:
            if plan is None:
                psnap = self.primary.snapshot(self.config.patterns, self.config.rules)
                viewed = self._mirror_view()
                if viewed is None:
                    self._refresh_manifest()  # (a view is only kept of a prefix no other node writes)
                else:
                    msnap, fresh = viewed
                    plan = pruner.plan(psnap, msnap)
                    if plan.deletions and not self._as_viewed(plan, msnap, fresh):
                        plan = None
                if plan is None:
                    entries = self.manifest.entries  # (read before the listing: see reconcile)
                    msnap = self.mirror.snapshot(self.config.patterns, self.config.rules)
                    self._keep(msnap, entries)
            # (stale uploads are swept by the reconciles' passes: listing them is a LIST request too)
            report = pruner.run_cycle(psnap, msnap, plan=plan, keep_going=self._between_deletions, sweep=reconciled)
        except MirrordError as exc:
            self._listed = None
            self.log.error("prune.failed", reason=exc.reason, path=exc.path, cause=exc.cause)
            return
        self._deleted(report)
        if Veto.RECENTLY_SEEN in report.skips_by_reason():
            # Observations mature min_age_seconds after they start: look again then (the observation
            # clock is monotonic, so this never hastens a deletion; a later rescan also covers it).
            due = self.monotonic() + self.config.prune.min_age_seconds
            self.inbox.prune_when(due)

    def _keep(self, msnap: Snapshot | None, entries: Mapping[str, ManifestEntry]) -> None:
        """Keep a complete listing of the mirror for the prune passes until the next reconcile; not when other
        nodes write under the prefix too (what they upload meanwhile is only seen by listing it)."""
        shared = self.config.s3.units_span_nodes or any(foreign(e, self.mirror.node) for e in entries.values())
        # (only its files and versions are read: see _mirror_view)
        self._listed = (msnap, entries, self.config) if msnap is not None and msnap.complete and not shared else None

    def _as_viewed(self, plan: PrunePlan, msnap: Snapshot, fresh: set[str]) -> bool:
        """Before a pass deletes on the strength of the view: the copies its decision rests on (each run's newest
        verified one, which the guards keep as the only good copy, and the keep_last newest verified ones, or what
        the trainer keeps in follow mode, which retire the older) are still as the view says: stat'ed unless they
        just were (past RESTAT_MAX of them, a listing is cheaper). One deleted or replaced behind the daemon's back
        drops the view: the pass plans from a new listing, never from what a stale view says of it."""
        kept = {k.rel for k in plan.kept if k.volume == MIRROR and k.why in (KEEP_LAST, FOLLOWED)}
        evidence = (kept | plan.newest) & msnap.files.keys() - fresh
        stale = len(evidence) > RESTAT_MAX
        for rel in () if stale else evidence:
            try:
                state = self.mirror.stat(rel)
            except (OSError, MirrordError):
                state = None
            if stale := state is None or state.identity != msnap.files[rel].identity:
                self.log.info("prune.relisting", path=rel, why="not as last listed")
                break
        if stale:
            self._listed = None
        return not stale

    def _mirror_view(self) -> tuple[Snapshot, set[str]] | None:
        """The mirror as last listed, brought up to date with the records changed since (a copy recorded, a
        record dropped by make_room): each of their files stat'ed (returned with the view); None when a
        listing is due instead."""
        if self._listed is None or self._listed[2] is not self.config:  # (listed under a config since reloaded)
            return None
        listed, was, config = self._listed
        entries = self.manifest.entries
        changed = {rel for rel, e in entries.items() if was.get(rel) is not e} | (was.keys() - entries.keys())
        if len(changed) > RESTAT_MAX:
            return None
        files, versions = dict(listed.files), dict(listed.versions)
        for rel in changed:
            try:
                state = self.mirror.stat(rel)
            except (OSError, MirrordError):
                return None  # (unknown is not gone: listed again)
            side = versions if rel.startswith(VERSIONS + "/") else files
            if state is not None and state.is_regular:
                side[rel] = state
            else:
                side.pop(rel, None)
        self._listed = Snapshot(files, versions=versions), entries, config
        return self._listed[0], changed

    def _deleted(self, report: PruneReport) -> None:
        """The mirror's view without what the pass deleted; dropped when the mirror was not as the view said (a
        file changed or gone behind the daemon's back) or the pass failed: the next pass lists it again."""
        if self._listed is None or report.dry_run:
            return
        vanished = any(s.volume == MIRROR and s.reason == VANISHED for s in report.skipped)
        if vanished or report.changed or not report.ok:
            self._listed = None
            return
        gone = {d.rel for d in report.deleted if d.volume == MIRROR}
        listed, entries, config = self._listed
        files, versions = ({rel: f for rel, f in m.items() if rel not in gone} for m in (listed.files, listed.versions))
        self._listed = Snapshot(files, versions=versions), {e: v for e, v in entries.items() if e not in gone}, config

    def _refresh_manifest(self) -> None:
        """Take in what other nodes recorded under a shared prefix (Manifest.refresh) before a plan."""
        try:
            self.manifest.refresh()
        except MirrordError as exc:  # planned from what we know: a stale view only keeps more
            self.log.warning("manifest.refresh_failed", path=exc.path, cause=exc.cause)

    def _between_deletions(self) -> bool:
        """A long prune pass keeps the daemon alive: new checkpoints are queued (workers copy meanwhile),
        the heartbeat (WATCHDOG=1, /healthz) goes on, and a stop request ends the pass."""
        if self.inbox.hints and self.drain_hints():
            self.inbox.rescan_asked = True
        self.heartbeat()
        return not self.stopping()
