"""From a view of the primary and the mirror to the queue: plan with what the daemon knows, drop the jobs
that must not run (judged invalid, copying in a loop, damage that a fresh stat disproves), queue the rest,
and keep track of what is still settling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from structlog.typing import FilteringBoundLogger

from mirrord.config import Config
from mirrord.core.jobs import CopyJob
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.nodes import own_view
from mirrord.core.observe import Observations
from mirrord.core.plan import SettleTracker, why_copy
from mirrord.core.reconcile import Facts, View, reconcile
from mirrord.core.retention import PrunePlan
from mirrord.core.units import group_units, unit_identity
from mirrord.obs.log import get_logger
from mirrord.service.inbox import Inbox
from mirrord.service.jobqueue import JobQueue
from mirrord.service.ledger import VERIFY_FAILURES, Ledger
from mirrord.service.refusals import Refusals
from mirrord.service.settings import Settings
from mirrord.store.completeness import Looks, judge, recorded_names, sharing_for
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.volume import LocalVolume, stat_safely


@dataclasses.dataclass(eq=False, kw_only=True)
class Enqueuer:
    """Plans a view (a full listing, or the files a hint or a recheck named) and queues its jobs."""

    settings: Callable[[], Settings]
    primary: LocalVolume
    mirror: Mirror
    manifest: Manifest
    queue: JobQueue
    ledger: Ledger
    refusals: Refusals
    inbox: Inbox
    settle: SettleTracker
    observations: Observations
    wall: Callable[[], float]
    monotonic: Callable[[], float]
    unsettled: set[str] = dataclasses.field(default_factory=set, init=False)
    looks: Looks = dataclasses.field(init=False)
    log: FilteringBoundLogger = dataclasses.field(default_factory=get_logger, init=False)

    def __post_init__(self) -> None:
        self.looks = Looks(self.monotonic)  # on the loop's clock, which tests may drive

    @property
    def config(self) -> Config:
        """The config in force now."""
        return self.settings().config

    def view(
        self,
        psnap: Snapshot,
        msnap: Snapshot | None,
        entries: Mapping[str, ManifestEntry],
        problem: str | None = None,
        partial: bool = False,
    ) -> View:
        """reconcile() with what this daemon knows; `partial`: the files watch hints named, judged by the
        retention of the last complete pass (what it retired stays retired)."""
        pruner = self.settings().pruner
        if partial:
            facts, retired_by = Facts(invalid=self.ledger.invalid_files()), (pruner and pruner.last_plan) or PrunePlan()
        else:
            observed = self.observations.observe(psnap, msnap) if msnap is not None and pruner else None
            facts = Facts(
                mirror_problem=problem,
                observed=observed,
                invalid=self.ledger.invalid_files(),
                mirror_is_mount=self.mirror.is_mountpoint(),
                roots=pruner.roots if pruner else None,
                **(pruner.evidence() if pruner else {}),
            )
            retired_by = None
        return copy_view(
            self.config,
            self.primary,
            self.mirror,
            self.manifest,
            entries,
            self.settle,
            psnap,
            msnap,
            facts,
            self.looks,
            frozenset(self.queue.paths()),
            retired_by,
        )

    def enqueue(self, view: View, psnap: Snapshot, partial: bool = False, scope: set[str] | None = None) -> int:
        """Queue the view's jobs; returns how many were queued. `partial`: the view covered only the files
        of `psnap` (or the units of `scope`), so only their settling state is replaced."""
        if self.refusals.blocked:  # every enqueue path honours a refusal (the settle recheck, hints, reconciles)
            self.refusals.missed = True
            return 0
        behind, jobs = [], []
        for job in view.jobs:  # without the steps retention retired (prune.primary = false keeps them)
            if self._judged_invalid(job, psnap):
                continue  # judged invalid as it is now; read again once it changes and settles again
            if job.why in VERIFY_FAILURES and not job.members and not self._still_damaged(job, psnap.files[job.rel]):
                continue  # published and recorded while we listed: not damage, not a job
            behind.append(job)
            if not self.ledger.copy_loops(job):
                state = psnap.files.get(job.rel)  # seen renamed into place: evidence of wholeness
                jobs.append(
                    job
                    if state is None or not self.settle.committed(state)
                    else dataclasses.replace(job, committed=True)
                )
        if partial:
            covered = set(psnap.files) if scope is None else scope
            self.unsettled.difference_update(covered - set(view.unsettled))
            self.unsettled.update(view.unsettled)
        else:
            self.unsettled = set(view.unsettled)
            if psnap.complete:
                rules = self.config.rules
                units = group_units(psnap.files.values(), rules) if rules.folders else {}
                self.ledger.keep_invalid(units or psnap.files)  # (a folder unit's verdict is the unit's)
                self.settle.retain(psnap.files.keys() | units.keys() if units else psnap.files)
        self.ledger.behind(behind, not partial, self.manifest.entries)
        seen = self.manifest.last_seq
        queued = [job for job in jobs if self.queue.put(dataclasses.replace(job, seen=seen))]
        for job in queued:
            if job.why in VERIFY_FAILURES:
                self.ledger.damaged(job)
        return len(queued)

    def _judged_invalid(self, job: CopyJob, psnap: Snapshot) -> bool:
        """The job's source (a file, or every file of a folder unit) is exactly what failed its validator."""
        states = [psnap.files[rel] for rel in job.paths if rel in psnap.files]
        if len(states) < len(job.paths):
            return False
        return self.ledger.judged_invalid(job.rel, unit_identity(states) if job.members else states[0].identity)

    def _still_damaged(self, job: CopyJob, src: FileState) -> bool:
        """Recheck a 'missing' or 'mismatched' mirror copy against a fresh stat and manifest record: a
        copy published between the listing and the plan is not damage (no false verify failures)."""
        return why_copy(src, self.manifest.get(job.rel), stat_safely(self.mirror, job.rel)) in VERIFY_FAILURES


def copy_view(
    config: Config,
    primary: LocalVolume,
    mirror: Mirror,
    manifest: Manifest,
    entries: Mapping[str, ManifestEntry],
    settle: SettleTracker,
    psnap: Snapshot,
    msnap: Snapshot | None,
    facts: Facts,
    looks: Looks,
    in_flight: frozenset[str] = frozenset(),
    retired_by: PrunePlan | None = None,
) -> View:
    """reconcile() for a copier (the daemon, `mirrord sync`), its inputs assembled in one place: what has
    settled, whether each unit is whole, the units shared with other nodes, and the manifest as this node
    plans from. `entries`: the manifest as read before the listings. Every file and unit of the listing is
    judged at the same instant of `settle`'s clocks."""
    now = settle.monotonic()
    settled = settle.at(now)
    return reconcile(
        psnap,
        msnap,
        entries,
        config,
        settle.wall(),
        in_flight,
        settled,
        facts=facts,
        retired_by=retired_by,
        is_complete=judge(
            primary,
            config.rules,
            settle.quiet_at(now),
            looks,
            recorded=recorded_names(entries, config.rules),
        ),
        sharing=sharing_for(config, manifest, primary, settled),
        own=own_view(entries, mirror.node, manifest.matched, psnap.files),
    )
