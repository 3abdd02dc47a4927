"""The retention executor: plan (mirrord.retention), then delete file by file after checking again.

Before deleting, each file is stat'ed afresh (beneath its root, never through a symlink) and must
still be the file that was planned; the guards are applied again to that fresh stat with a fresh
clock and in-flight set, because the world may have changed since the listing; the unlink itself
checks the inode, size and mtime once more. Deleting mirrored files first drops their manifest
entries (one durable journal record per batch), so the manifest never vouches for a file that is
gone. One log event per decision: prune.deleted, prune.skipped (reason), prune.refused (reason);
prune.would_delete in dry-run mode.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from mirrord.config import Config
from mirrord.errors import MirrordError
from mirrord.guards import NOT_REGULAR, REASONS, UNMIRRORED, GuardContext, veto
from mirrord.log import get_logger
from mirrord.manifest import Manifest
from mirrord.metrics import Metrics
from mirrord.model import FileState, ManifestEntry, Snapshot
from mirrord.observe import Observations
from mirrord.retention import MIRROR, PRIMARY, STEP, Deletion, PrunePlan, Skipped, exact_copy, plan_prune
from mirrord.volume import ChangedError, LocalVolume, Mirror

VANISHED = "vanished"  # gone before we got to it: nothing to do, not a guard's veto
CHANGED = "changed"  # no longer the file that was planned: reconsidered next cycle
DISABLED = "disabled"
# Deletions re-checked together and whose manifest entries go in one journal record (one fsync).
BATCH = 64


@dataclass
class PruneReport:
    """What one cycle did. `refused` (whole cycle) and `failed` (single files) make it not ok."""

    plan: PrunePlan = field(default_factory=PrunePlan)
    dry_run: bool = False
    disabled: bool = False
    deleted: list[Deletion] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (reason, detail): nothing deleted
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # (volume, rel, reason)
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # (volume, rel, cause)
    interrupted: bool = False  # a stop was requested: the rest waits for the next pass

    @property
    def ok(self) -> bool:
        return not self.refused and not self.failed

    def freed_bytes(self, volume: str | None = None) -> int:
        return sum(d.state.size for d in self.deleted if volume is None or d.volume == volume)

    def skips_by_reason(self) -> dict[str, int]:
        return dict(Counter(s.reason for s in self.skipped))


def _fields(volume: str, state: FileState, step: int | None) -> dict[str, Any]:
    return {"volume": volume, "path": state.rel, "run": state.run or ".", "step": step, "size": state.size}


class Pruner:
    """Retention for one primary/mirror pair, shared by `mirrord prune` and the daemon.

    `in_flight()` returns the root-relative paths queued or being copied in this process (a path
    must stay in it until its manifest record is written). The caller holds the mirror lock.
    """

    def __init__(
        self,
        config: Config,
        primary: LocalVolume,
        mirror: Mirror,
        manifest: Manifest,
        metrics: Metrics | None = None,
        wall: Callable[[], float] = time.time,
        in_flight: Callable[[], frozenset[str]] = frozenset,
        observations: Observations | None = None,
        invalid: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self.config = config
        self.primary = primary
        self.mirror = mirror
        self.manifest = manifest
        self.metrics = metrics or Metrics()
        self.wall = wall
        self.in_flight = in_flight
        # The daemon's, shared across cycles and reloads: with it, the min-age guard also needs this
        # process to have seen a file unchanged for min_age_seconds (monotonic). A one-shot command
        # has seen nothing, so it passes none and relies on mtimes alone.
        self.observations = observations
        self.invalid = invalid  # primary files that failed their validator as they are now
        self.log = get_logger()
        self._lock = threading.Lock()
        self._last_plan: PrunePlan | None = None
        # (volume, path, reason) vetoes already logged: a young file kept for many passes is one
        # prune.skipped line, not one per pass (the metric still counts every pass).
        self._skips_logged: set[tuple[str, str, str]] = set()
        self._skips_seen: set[tuple[str, str, str]] = set()
        self._roots = {
            PRIMARY: PurePath(primary.root.resolve()),
            MIRROR: PurePath(mirror.root.resolve()),
        }

    def plan(self, primary_snap: Snapshot | None = None, mirror_snap: Snapshot | None = None,
             space_pressure: bool = False) -> PrunePlan:
        """List both sides (unless given the daemon's own snapshots) and plan; deletes nothing."""
        psnap = primary_snap if primary_snap is not None else self.primary.snapshot(self.config.patterns)
        msnap = mirror_snap if mirror_snap is not None else self.mirror.snapshot(self.config.patterns)
        is_mount = self.mirror.root.is_mount() if self.config.mirror_must_be_mountpoint else None
        observed = None
        if self.observations is not None:
            observed = self.observations.update(PRIMARY, psnap.files.values())
            observed.update(self.observations.update(MIRROR, [*msnap.files.values(), *msnap.partials.values()]))
        plan = plan_prune(
            psnap, msnap, self.manifest.entries, frozenset(self.in_flight()), self.wall(),
            self.config.prune, self.config.step_regex, self._roots, is_mount, observed, self.invalid(),
            space_pressure,
        )
        if not plan.refused and not space_pressure:
            self._last_plan = plan
        return plan

    def retired(self, run: str, step: int | None, mtime_ns: int | None = None) -> bool:
        """True if the last plan put this step of this run below the window (and no policy keeps it).

        The copy planner should skip such files: with prune.primary = false the primary still has
        them, and copying them again would only have them pruned again.
        """
        plan = self._last_plan
        return plan is not None and plan.retired(run, step, mtime_ns)

    def run_cycle(
        self,
        primary_snap: Snapshot | None = None,
        mirror_snap: Snapshot | None = None,
        dry_run: bool | None = None,
        keep_going: Callable[[], bool] = lambda: True,
    ) -> PruneReport:
        """Plan and execute one retention pass. With prune.enabled = false only a dry run plans.

        `keep_going` is asked between deletions (the daemon beats its heartbeat there and says no once
        a stop was requested): a pass of thousands of deletions never holds the caller for long.
        """
        dry = self.config.prune.dry_run if dry_run is None else dry_run
        if not self.config.prune.enabled and not dry:
            self.log.debug("prune.disabled")
            return PruneReport(disabled=True)
        with self._lock:
            plan = self.plan(primary_snap, mirror_snap)
            report = self._execute(plan, dry, (PRIMARY, MIRROR), keep_going=keep_going)
        # A dry run deletes nothing: its totals are what it would delete, and are named so.
        count, mirror_bytes = len(report.deleted), report.freed_bytes(MIRROR)
        primary_bytes = report.freed_bytes(PRIMARY)
        totals = (
            {"would_delete": count, "would_free_bytes_mirror": mirror_bytes, "would_free_bytes_primary": primary_bytes}
            if dry else {"deleted": count, "freed_bytes_mirror": mirror_bytes, "freed_bytes_primary": primary_bytes}
        )
        self.log.info(
            "prune.finished", dry_run=dry, **totals, interrupted=report.interrupted, skipped=report.skips_by_reason(),
            refused=[r for r, _ in report.refused], failed=len(report.failed),
        )
        return report

    def execute(self, plan: PrunePlan, dry_run: bool = False) -> PruneReport:
        """Carry out a plan made earlier (the daemon may plan from its own snapshots)."""
        with self._lock:
            return self._execute(plan, dry_run, (PRIMARY, MIRROR))

    def make_room(self, bytes_needed: int) -> None:
        """Called before a copy that does not fit: prune the mirror, oldest first, until it fits.

        Only what retention would delete anyway is deleted - never a kept step. If that is not
        enough the copy fails with "no space" and its metric.
        """
        prune = self.config.prune
        if not prune.enabled or prune.dry_run:
            self.log.info("prune.make_room", needed=bytes_needed, outcome=DISABLED)
            return
        with self._lock:
            free, _ = self.mirror.space()
            if free >= bytes_needed:
                return
            plan = self.plan(space_pressure=True)
            report = self._execute(plan, False, (MIRROR,), lambda: self.mirror.space()[0] >= bytes_needed)
            free, _ = self.mirror.space()
        self.log.info(
            "prune.make_room", needed=bytes_needed, free=free, freed=report.freed_bytes(),
            deleted=len(report.deleted), outcome="enough" if free >= bytes_needed else "not_enough",
        )

    def _execute(
        self,
        plan: PrunePlan,
        dry_run: bool,
        volumes: Iterable[str],
        enough: Callable[[], bool] | None = None,
        keep_going: Callable[[], bool] = lambda: True,
    ) -> PruneReport:
        volumes = tuple(volumes)
        report = PruneReport(plan=plan, dry_run=dry_run)
        if plan.refused:
            for reason, detail in plan.refused:
                self.log.error("prune.refused", reason=reason, detail=detail, deleted=0)
                self.metrics.prune_refusal(reason)
            report.refused.extend(plan.refused)
            return report
        for kept in plan.kept:
            self.log.debug("prune.kept", volume=kept.volume, path=kept.rel, step=kept.step, why=kept.why)
        self._skips_seen = set()
        for skip in plan.skipped:
            if skip.volume in volumes:
                self._skip(report, skip)
        if set(volumes) == {PRIMARY, MIRROR}:
            self._skips_logged &= self._skips_seen  # forget files no longer vetoed (bounded memory)
        todo = [d for d in plan.deletions if d.volume in volumes]
        if dry_run:
            for deletion in todo:
                self.log.info("prune.would_delete", kind=deletion.kind,
                              **_fields(deletion.volume, deletion.state, deletion.step))
                report.deleted.append(deletion)
            return report
        for start in range(0, len(todo), BATCH):
            if not self._delete_batch(todo[start:start + BATCH], plan, report, keep_going, enough):
                break
        return report

    def _mirror_still_there(self, report: PruneReport) -> bool:
        """Before every deletion, on either side: the mirror is still the volume that was pinned. A
        primary deletion is only safe while the copy it relies on is really there."""
        try:
            self.mirror.check_identity()
        except MirrordError as exc:
            self.log.error("prune.refused", reason=exc.reason, detail=exc.cause, deleted=len(report.deleted))
            self.metrics.prune_refused.labels(exc.reason).inc()
            report.refused.append((exc.reason, exc.cause))
            return False
        return True

    def _skip(self, report: PruneReport, skip: Skipped) -> None:
        report.skipped.append(skip)
        key = (skip.volume, skip.rel, skip.reason)
        self._skips_seen.add(key)
        log = self.log.debug if key in self._skips_logged else self.log.info
        self._skips_logged.add(key)
        log("prune.skipped", volume=skip.volume, path=skip.rel, step=skip.step, reason=skip.reason)
        if skip.reason in REASONS:
            self.metrics.prune_skipped.labels(skip.reason).inc()

    def _delete_batch(
        self,
        batch: list[Deletion],
        plan: PrunePlan,
        report: PruneReport,
        keep_going: Callable[[], bool],
        enough: Callable[[], bool] | None,
    ) -> bool:
        """Re-check a batch, drop the manifest entries of its mirrored files in one durable record, then
        unlink file by file. False means stop the cycle (asked to stop, enough room, or no manifest).

        Entries go before files, so the manifest never vouches for a file that is gone; an entry whose
        file is not deleted after all (an I/O error, a stop request) is recorded again.
        """
        ready: list[tuple[Deletion, FileState, ManifestEntry | None]] = []
        for d in batch:
            if not keep_going():
                report.interrupted = True
                return False  # nothing of this batch was recorded or deleted yet
            fresh = self._recheck(d, plan, report)
            if fresh is not None:
                entry = self.manifest.get(d.rel) if d.volume == MIRROR and d.kind == STEP else None
                ready.append((d, fresh, entry))
        dropped = [entry for _, _, entry in ready if entry is not None]
        if dropped:
            try:
                self.manifest.apply(removes=[e.path for e in dropped])
            except MirrordError as exc:
                # Without a writable manifest no deletion can be recorded: stop the whole cycle.
                for d, _, entry in ready:
                    if entry is not None:
                        self._refuse_file(report, d, exc.reason, exc.cause, failed=True)
                report.refused.append((exc.reason, exc.cause))
                return False
        restore: list[ManifestEntry] = []
        go_on = True
        for i, (d, fresh, entry) in enumerate(ready):
            if i and ((enough is not None and enough()) or not keep_going()):
                report.interrupted = enough is None
                restore += [e for _, _, e in ready[i:] if e is not None]
                go_on = False
                break
            if not self._mirror_still_there(report):
                restore += [e for _, _, e in ready[i:] if e is not None]
                go_on = False
                break
            if not self._unlink(d, fresh, entry, report) and entry is not None:
                restore.append(entry)  # the file is still there and still what was recorded
        if go_on and enough is not None and enough():
            go_on = False
        if restore:
            try:
                self.manifest.apply(puts=restore)
            except MirrordError as exc:  # they stay unrecorded: copied and recorded again by a later pass
                self.log.error("prune.rerecord_failed", files=len(restore), reason=exc.reason, cause=exc.cause)
        return go_on

    def _recheck(self, d: Deletion, plan: PrunePlan, report: PruneReport) -> FileState | None:
        """A fresh stat that is still the planned file and that no guard vetoes, else None (reported)."""
        volume = self.primary if d.volume == PRIMARY else self.mirror
        try:
            fresh = volume.stat(d.rel)
        except ValueError:
            self._skip(report, Skipped(d.volume, d.rel, d.step, NOT_REGULAR, d.state.size))
            return None
        except OSError as exc:
            self._refuse_file(report, d, "restat_failed", exc.strerror or str(exc), failed=True)
            return None
        if fresh is None:
            self._skip(report, Skipped(d.volume, d.rel, d.step, VANISHED, d.state.size))
            return None
        if (fresh.ino, fresh.size, fresh.mtime_ns, fresh.mode) != (
            d.state.ino, d.state.size, d.state.mtime_ns, d.state.mode
        ):
            self._refuse_file(report, d, CHANGED, "no longer the file that was planned")
            return None
        ctx = GuardContext(
            now=self.wall(),
            min_age_seconds=self.config.prune.min_age_seconds,
            future_skew_seconds=self.config.prune.future_skew_seconds,
            in_flight=frozenset(self.in_flight()),
            newest=plan.newest,
            roots=self._roots,
            observed=None if self.observations is None else {
                (d.volume, d.rel): self.observations.seen_for(d.volume, fresh)},
        )
        reason = veto(d.volume, fresh, ctx)
        if reason is None and d.volume == PRIMARY and not self._mirror_vouches(fresh):
            reason = UNMIRRORED
        if reason is not None:
            self._skip(report, Skipped(d.volume, d.rel, d.step, reason, fresh.size))
            return None
        return fresh

    def _unlink(self, d: Deletion, fresh: FileState, entry: ManifestEntry | None, report: PruneReport) -> bool:
        """Delete one re-checked file; False if it is still there (its entry should be recorded again)."""
        volume = self.primary if d.volume == PRIMARY else self.mirror
        try:
            volume.delete(d.rel, fresh)
        except ChangedError as exc:
            self._refuse_file(report, d, CHANGED, exc.cause)
            return True  # it is not the recorded file any more: the entry must not come back
        except MirrordError as exc:
            self._refuse_file(report, d, exc.reason, exc.cause, failed=True)
            return False
        report.deleted.append(d)
        self.metrics.pruned_files.labels(d.volume).inc()
        self.metrics.pruned_bytes.labels(d.volume).inc(fresh.size)
        self.log.info("prune.deleted", kind=d.kind, manifest_entry=entry is not None,
                      **_fields(d.volume, d.state, d.step))
        return True

    def _mirror_vouches(self, src: FileState) -> bool:
        """Just before unlinking a primary file: the mirror still holds a verified copy of exactly it."""
        entry = self.manifest.get(src.rel)
        try:
            dst = self.mirror.stat(src.rel)
        except (OSError, ValueError):
            return False
        if entry is None or dst is None:
            return False
        return exact_copy(src, {src.rel: entry}, {src.rel: dst})

    def _refuse_file(
        self, report: PruneReport, d: Deletion, reason: str, cause: str, failed: bool = False
    ) -> None:
        (report.failed if failed else report.changed).append((d.volume, d.rel, f"{reason}: {cause}"))
        log = self.log.error if failed else self.log.warning
        log("prune.refused", reason=reason, detail=cause, **_fields(d.volume, d.state, d.step))
        self.metrics.prune_refusal(reason)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def describe(report: PruneReport) -> str:
    """For a person: what was (or would be) deleted, what is kept and why, what a guard skipped."""
    if report.disabled:
        return "pruning is disabled (prune.enabled = false): nothing deleted; --dry-run shows the plan"
    plan = report.plan
    lines = [f"REFUSED ({reason}): {detail}" for reason, detail in report.refused]
    verb = "would delete" if report.dry_run else "deleted"
    rels = [d.rel for d in report.deleted] + [k.rel for k in plan.kept] + [s.rel for s in report.skipped]
    width = max(map(len, rels), default=0)
    lines.append(f"{verb} {len(report.deleted)} file(s), {_size(report.freed_bytes())}:")
    for d in report.deleted:
        what = d.kind if d.step is None else f"step {d.step}"
        lines.append(f"  {d.volume:8} {d.rel:{width}}  {what}  {_size(d.state.size)}")
    lines.append(f"kept {len(plan.kept)} file(s):")
    lines.extend(f"  {k.volume:8} {k.rel:{width}}  {k.why}" for k in plan.kept)
    lines.append(f"skipped {len(report.skipped)} file(s):")
    lines.extend(f"  {s.volume:8} {s.rel:{width}}  {s.reason}" for s in report.skipped)
    if report.changed or report.failed:
        lines.append(f"not deleted {len(report.changed) + len(report.failed)} file(s):")
        lines.extend(f"  {v:8} {rel}  {why}" for v, rel, why in report.changed + report.failed)
    freed = ", ".join(f"{v} {_size(report.freed_bytes(v))}" for v in (MIRROR, PRIMARY))
    skips = ", ".join(f"{r}={n}" for r, n in sorted(report.skips_by_reason().items())) or "none"
    outcome = f"{verb} {len(report.deleted)} file(s) ({freed})"
    if report.refused:
        outcome = f"REFUSED; {outcome}"
    lines.append(f"summary: {outcome}; kept {len(plan.kept)}; skipped: {skips}"
                 + ("; dry run: nothing was deleted" if report.dry_run else ""))
    return "\n".join(lines)
