"""From a view of the primary and the mirror to the queue: plan with what the daemon knows, drop the jobs
that must not run (judged invalid, copying in a loop, damage that a fresh stat disproves), queue the rest,
and keep track of what is still settling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from mirrord.config import Config
from mirrord.core.jobs import CopyJob
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.nodes import own_view
from mirrord.core.observe import Observations
from mirrord.core.plan import SettleTracker, why_copy
from mirrord.core.reconcile import Facts, View, reconcile
from mirrord.core.retention import PrunePlan
from mirrord.core.units import group_units, unit_identity
from mirrord.errors import UnsafePathError
from mirrord.obs.log import get_logger
from mirrord.service.inbox import Inbox
from mirrord.service.jobqueue import JobQueue
from mirrord.service.ledger import VERIFY_FAILURES, Ledger
from mirrord.service.refusals import Refusals
from mirrord.service.settings import Settings
from mirrord.store.completeness import judge, recorded_names, sharing_for
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.volume import LocalVolume


class Enqueuer:
    """Plans a view (a full listing, or the files a hint or a recheck named) and queues its jobs."""

    def __init__(
        self,
        *,
        settings: Callable[[], Settings],
        primary: LocalVolume,
        mirror: Mirror,
        manifest: Manifest,
        queue: JobQueue,
        ledger: Ledger,
        refusals: Refusals,
        inbox: Inbox,
        settle: SettleTracker,
        observations: Observations,
        wall: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self.settings, self.primary, self.mirror, self.manifest = settings, primary, mirror, manifest
        self.queue, self.ledger, self.refusals, self.inbox = queue, ledger, refusals, inbox
        self.settle, self.observations = settle, observations
        self.wall, self.monotonic = wall, monotonic
        self.unsettled: set[str] = set()
        self.log = get_logger()

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
        cfg, pruner = self.config, self.settings().pruner
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
                pointed=pruner.pointed() if pruner else frozenset(),
            )
            retired_by = None
        now = self.monotonic()
        settled = self.settle.at(now)
        complete = judge(
            self.primary, cfg.rules, self.settle.quiet_at(now), tell=True, recorded=recorded_names(entries, cfg.rules)
        )
        own = own_view(entries, self.mirror.node, self.manifest.matched, psnap.files)
        return reconcile(
            psnap,
            msnap,
            entries,
            cfg,
            self.wall(),
            frozenset(self.queue.paths()),
            settled,
            facts=facts,
            retired_by=retired_by,
            is_complete=complete,
            sharing=sharing_for(cfg, self.manifest, self.primary, settled),
            own=own,
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


def stat_safely(volume: LocalVolume | Mirror, rel: str) -> FileState | None:
    """The state of `rel`, or None when it is gone or cannot be reached safely."""
    try:
        return volume.stat(rel)
    except (OSError, UnsafePathError):
        return None
