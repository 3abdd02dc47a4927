"""The retention executor (the daemon's and `mirrord prune`'s): plan (mirrord.core.retention), then delete file
by file after checking again.

Before deleting, each file is stat'ed afresh (beneath its root, never through a symlink) and must
still be the file that was planned; the guards are applied again to that fresh stat with a fresh
clock and in-flight set, because the world may have changed since the listing; the unlink itself
checks the inode, size and mtime once more. Deleting mirrored files first drops their manifest
entries (one durable journal record per batch), so the manifest never vouches for a file that is
gone. One log event per decision: prune.deleted, prune.skipped (reason), prune.refused (reason);
prune.would_delete in dry-run mode.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mirrord.config import Config
from mirrord.core.guards import REASONS, veto
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.observe import Observations
from mirrord.core.reconcile import Facts, reconcile
from mirrord.core.retention import MIRROR, ORPHAN_STAGING, PRIMARY, STEP, Deletion, PrunePlan, Sightings, Skipped
from mirrord.errors import ChangedError, MirrordError, UnsafePathError
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.store.aliases import pointed_targets, tagged_targets, trainer_kept
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.staging import remove_folder
from mirrord.store.volume import LocalVolume, guard_roots
from mirrord.vocabulary import PruneRefusal, Veto

VANISHED = "vanished"  # gone before we got to it: nothing to do, not a guard's veto
CHANGED = PruneRefusal.CHANGED  # no longer the file that was planned: reconsidered next cycle
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
        """Whether the pass neither was refused nor failed a deletion."""
        return not self.refused and not self.failed

    def freed_bytes(self, volume: str | None = None) -> int:
        """Bytes deleted (on `volume`, or on both)."""
        return sum(d.state.size for d in self.deleted if volume is None or d.volume == volume)

    def skips_by_reason(self) -> dict[str, int]:
        """How many deletions each guard vetoed."""
        return dict(Counter(s.reason for s in self.skipped))


# What the line logged once while a checkpoint is held says (Pruner._tell).
HELD_CAUSES = {
    "paused": "the run's newest verified step is gone from the primary: its mirror is "
    "not shrunk until a newer step is verified (or --forget RUN:STEP)",
    "not_rotated": "gone from the primary without evidence that the trainer rotated it out (a wipe, a "
    "restore, an rm): kept on the mirror (--forget RUN:STEP drops it)",
    "branch_tip_kept": "the newest checkpoint of an abandoned branch (--forget RUN:STEP drops it)",
}


def _fields(d: Deletion) -> dict[str, Any]:
    return {
        "kind": d.kind,
        "volume": d.volume,
        "path": d.rel,
        "run": d.state.run or ".",
        "step": d.step,
        "size": d.state.size,
    }


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
        forget: frozenset[tuple[str, int]] = frozenset(),
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
        self.forget = forget  # (run, step) held checkpoints the operator let go (`prune --forget`)
        self._told: set[tuple[str, str, int | str]] = set()  # (what, run, step) paused runs and branch tips logged
        self.log = get_logger()
        self._lock = threading.Lock()
        # The retirement (PrunePlan.retirement) of the last plan made from a complete listing and not
        # refused: which steps are retired for a partial listing (the daemon's watch hints).
        self.last_plan: PrunePlan | None = None
        # Runs paused and mirror files kept by each Held reason in the last pass (the gauges read them).
        self.held: tuple[int, Mapping[str, int]] = (0, {})
        # (volume, path, reason) vetoes already logged: a young file kept for many passes is one
        # prune.skipped line, not one per pass (the metric still counts every pass).
        self._skips_logged: set[tuple[str, str, str]] = set()
        self._skips_seen: set[tuple[str, str, str]] = set()
        self.roots = guard_roots(primary, mirror)  # both roots, resolved once (the path guard compares against them)
        self._elsewhere: str | None = None  # why another node prunes the mirror, as last logged

    def plan(
        self, primary_snap: Snapshot | None = None, mirror_snap: Snapshot | None = None, space_pressure: bool = False
    ) -> PrunePlan:
        """List both sides (unless given snapshots) and plan through reconcile; deletes nothing."""
        rules = self.config.rules
        psnap = primary_snap if primary_snap is not None else self.primary.snapshot(self.config.patterns, rules)
        msnap = mirror_snap if mirror_snap is not None else self.mirror.snapshot(self.config.patterns, rules)
        observed = None if self.observations is None else self.observations.observe(psnap, msnap)
        facts = Facts(
            mirror_is_mount=self.mirror.is_mountpoint(),
            observed=observed,
            invalid=self.invalid(),
            roots=self.roots,
            space_pressure=space_pressure,
            forget=self.forget,
            **self.evidence(),
        )
        plan = reconcile(
            psnap,
            msnap,
            self.manifest.entries,
            self.config,
            self.wall(),
            frozenset(self.in_flight()),
            facts=facts,
            plan_retention=True,
        ).prune
        if not space_pressure:
            self._remember(plan)
        return plan

    def _remember(self, plan: PrunePlan) -> None:
        """Keep what a plan of complete listings tells the next: its retirement, and what it saw (follow)."""
        if not plan.refused:
            self.last_plan = plan.retirement()
            if plan.sightings is not None and self.observations is not None:
                self.observations.sightings = plan.sightings

    def evidence(self) -> dict[str, Any]:
        """Facts (mirrord.core.reconcile) of what the trainer keeps. `pointed`: what the pointers on the mirror
        name (Lightning's `last.ckpt` link, DeepSpeed's `latest` tag; on an object store, the tag files), and
        what the trainer's newest bookkeeping on the primary keeps (HF's best, Lightning's top k); `keeps`: how
        many checkpoints each run's trainer keeps by that record; `sightings`: what this process saw of the primary."""
        tree, layout = self.mirror.local_tree(), self.config.rules
        runs = {e.run for e in self.manifest.entries.values()}
        trainer = layout.rule == "hf" or layout.name == "lightning"
        best, keeps = trainer_kept(self.primary.root, self.manifest.entries, layout) if trainer else ((), {})
        if tree is None:
            pointed = tagged_targets(self.mirror, runs, layout.tag_file) if layout.tag_file else frozenset()
        else:
            pointed = pointed_targets(tree.root, runs, layout) if layout.aliases or layout.tag_file else frozenset()
        return {
            "pointed": pointed.union(best),
            "keeps": keeps,
            "sightings": self.observations.sightings if self.observations is not None else Sightings(),
        }

    def run_cycle(
        self,
        primary_snap: Snapshot | None = None,
        mirror_snap: Snapshot | None = None,
        dry_run: bool | None = None,
        keep_going: Callable[[], bool] = lambda: True,
        plan: PrunePlan | None = None,
        sweep: bool = True,
    ) -> PruneReport:
        """Plan and execute one retention pass. With prune.enabled = false only a dry run plans.

        `keep_going` is asked between deletions (the daemon beats its heartbeat there and says no once
        a stop was requested): a pass of thousands of deletions never holds the caller for long. `plan`
        is one the caller already made (the daemon's reconcile View): then nothing is listed again.
        `sweep`: also abort the object store's stale uploads (a listing of them: the daemon's rescans only).
        """
        dry = self.config.prune.dry_run if dry_run is None else dry_run
        if not self.config.prune.enabled and not dry:
            self.log.debug("prune.disabled")
            return PruneReport(disabled=True)
        listed = plan is None and (primary_snap is None or mirror_snap is None)
        with self._lock:
            sides = self._sides()
            if plan is None:
                plan = self.plan(primary_snap, mirror_snap)
            else:
                self._remember(plan)
            self.held = len(plan.paused), plan.held
            report = self._execute(plan, dry, sides, keep_going=keep_going)
            if sweep and not dry and MIRROR in sides:
                self._sweep_uploads()
        # A dry run deletes nothing: its totals are what it would delete, and are named so.
        freed = "would_free" if dry else "freed"
        totals = {f"{freed}_bytes_{volume}": report.freed_bytes(volume) for volume in (MIRROR, PRIMARY)}
        self.log.info(
            "prune.finished",
            dry_run=dry,
            **{"would_delete" if dry else "deleted": len(report.deleted)},
            **totals,
            interrupted=report.interrupted,
            skipped=report.skips_by_reason(),
            listed=listed,
            refused=[r for r, _ in report.refused],
            failed=len(report.failed),
        )
        return report

    def _sides(self) -> tuple[str, ...]:
        """The volumes this pass prunes. Several nodes sharing an object-store prefix: only the holder of
        its retention lease prunes the mirror (and sweeps its uploads), from the merged manifest; every
        node prunes its own primary (a file only while the mirror holds its verified copy)."""
        try:
            elsewhere = self.mirror.claim_retention()
        except MirrordError as exc:
            elsewhere = exc.cause
        if elsewhere != self._elsewhere:
            if elsewhere is None:
                self.log.info("prune.mirror_here", mirror=self.mirror.describe())
            else:
                self.log.info(
                    "prune.mirror_elsewhere",
                    mirror=self.mirror.describe(),
                    cause=elsewhere,
                    action="pruning the primary only",
                )
            self._elsewhere = elsewhere
        return (PRIMARY, MIRROR) if elsewhere is None else (PRIMARY,)

    def _sweep_uploads(self) -> None:
        """An object store: abort the multipart uploads a killed or failed copy left, once older than the
        age guard (a younger one may be another node's live upload). Their parts are billed until then."""
        try:
            self.mirror.sweep_stale_uploads(self.config.prune.min_age_seconds)
        except MirrordError as exc:
            self.log.warning("prune.upload_sweep_failed", path=exc.path, cause=exc.cause)

    def make_room(self, bytes_needed: int) -> None:
        """Called before a copy that does not fit: prune the mirror, oldest first, until it fits.

        Only what retention would delete anyway is deleted - never a kept step. If that is not
        enough the copy fails with "no space" and its metric.
        """
        prune = self.config.prune
        if not prune.enabled or prune.dry_run:
            self.log.info("prune.make_room", needed=bytes_needed, outcome=DISABLED)
            return

        def enough() -> bool:
            space = self.mirror.space()
            return space is None or space[0] >= bytes_needed  # None: the store cannot tell (never full)

        with self._lock:
            if enough():
                return
            plan = self.plan(space_pressure=True)
            report = self._execute(plan, False, (MIRROR,), enough)
            space = self.mirror.space()
        self.log.info(
            "prune.make_room",
            needed=bytes_needed,
            free=None if space is None else space[0],
            freed=report.freed_bytes(),
            deleted=len(report.deleted),
            outcome="enough" if enough() else "not_enough",
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
                self._refuse(report, reason, detail)
            return report
        # Bound once (every attribute of the lazy proxy binds anew), and skipped unless debug logging is on:
        # a daemon keeps every file of both sides at each pass.
        log = self.log.bind()
        if log.is_enabled_for(logging.DEBUG):
            for kept in plan.kept:
                log.debug("prune.kept", volume=kept.volume, path=kept.rel, step=kept.step, why=kept.why)
        self._tell(plan)
        self._skips_seen = set()
        for skip in plan.skipped:
            if skip.volume in volumes:
                self._skip(report, skip)
        if set(volumes) == {PRIMARY, MIRROR}:
            self._skips_logged &= self._skips_seen  # forget files no longer vetoed (bounded memory)
        todo = [d for d in plan.deletions if d.volume in volumes]
        if dry_run:
            for deletion in todo:
                self.log.info("prune.would_delete", **_fields(deletion))
            report.deleted.extend(todo)
            return report
        plain = [d for d in todo if not d.unit]
        for start in range(0, len(plain), BATCH):
            if not self._delete_batch(plain[start : start + BATCH], plan, report, keep_going, enough):
                return report
        groups: dict[tuple[str, str], list[Deletion]] = {}
        for d in todo:
            if d.unit:
                groups.setdefault((d.volume, d.unit), []).append(d)
        for (volume, unit), group in groups.items():
            if (enough is not None and enough()) or not self._delete_unit(
                volume, unit, group, plan, report, keep_going
            ):
                break
        return report

    def _tell(self, plan: PrunePlan) -> None:
        """Log each paused run and each kept branch tip once (while it lasts), not at every pass."""
        now: set[tuple[str, str, int | str]] = {("paused", run, step) for run, step in plan.paused.items()}
        now |= {("branch_tip_kept", run, step) for run, steps in plan.branch_tips.items() for step in steps}
        now |= {("not_rotated", run, step) for run, step in plan.unrotated}
        for what, run, step in sorted(now - self._told, key=str):
            log = self.log.info if what == "branch_tip_kept" else self.log.warning
            log(f"prune.{what}", run=run or ".", step=step, cause=HELD_CAUSES[what])
        self._told = now

    def _delete_unit(
        self,
        volume: str,
        unit: str,
        group: list[Deletion],
        plan: PrunePlan,
        report: PruneReport,
        keep_going: Callable[[], bool],
    ) -> bool:
        """Delete a folder unit whole: every file re-checked first (a file a guard now keeps keeps the
        whole unit); then, on the mirror, the manifest entries, then the folder (renamed aside in one
        step, then removed); on the primary, the files, then the emptied folder. False: stop the cycle."""
        fresh: list[FileState] = []
        for d in group:
            if not keep_going():
                report.interrupted = True
                return False
            state = self._recheck(d, plan, report)
            if state is None:
                self.log.info("prune.unit_kept", volume=volume, path=unit, because=d.rel)
                return True
            fresh.append(state)
        if not self._mirror_still_there(report, volume):
            return False
        if volume == PRIMARY:
            for d, state in zip(group, fresh, strict=True):
                if not self._unlink(d, state, None, report):
                    return True
            remove_folder(self.primary.root, unit)
            self._unit_deleted(volume, unit, group, fresh, 0)
            return True
        entries = [e for e in (self.manifest.get(d.rel) for d in group) if e is not None]
        try:
            if entries:
                self.manifest.apply(removes=[e.path for e in entries])
        except MirrordError as exc:
            report.refused.append((exc.reason, exc.cause))
            return False
        try:
            self.mirror.delete_unit(unit, [(d.rel, state) for d, state in zip(group, fresh, strict=True)])
        except MirrordError as exc:
            for d in group:
                self._refuse_file(report, d, exc.reason, exc.cause, failed=True)
            self._rerecord(entries)
            return True
        report.deleted.extend(group)
        self.metrics.pruned_files.labels(volume).inc(len(group))
        self.metrics.pruned_bytes.labels(volume).inc(sum(state.size for state in fresh))
        self._unit_deleted(volume, unit, group, fresh, len(entries))
        return True

    def _unit_deleted(
        self, volume: str, unit: str, group: list[Deletion], fresh: list[FileState], entries: int
    ) -> None:
        self.log.info(
            "prune.deleted",
            kind="unit",
            volume=volume,
            path=unit,
            step=group[0].step,
            run=unit.rsplit("/", 1)[0] if "/" in unit else ".",
            files=len(group),
            size=sum(state.size for state in fresh),
            manifest_entries=entries,
        )

    def _mirror_still_there(self, report: PruneReport, volume: str) -> bool:
        """Before every deletion, on either side: the mirror is still the volume that was pinned. A
        primary deletion is only safe while the copy it relies on is really there. A deletion on a shared
        object store: this node still holds its retention lease."""
        try:
            self.mirror.check_identity()
            if volume == MIRROR:
                self.mirror.require_retention()
        except MirrordError as exc:
            self._refuse(report, exc.reason, exc.cause)
            return False
        return True

    def _refuse(self, report: PruneReport, reason: str, detail: str) -> None:
        """The pass deletes nothing (more), for `reason`: logged, counted, reported."""
        self.log.error("prune.refused", reason=reason, detail=detail, deleted=len(report.deleted))
        self.metrics.prune_refusal(reason)
        report.refused.append((reason, detail))

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
            stopped = bool(i) and ((enough is not None and enough()) or not keep_going())
            if stopped:
                report.interrupted = enough is None
            if stopped or not self._mirror_still_there(report, d.volume):
                restore += [e for _, _, e in ready[i:] if e is not None]
                go_on = False
                break
            if not self._unlink(d, fresh, entry, report) and entry is not None:
                restore.append(entry)  # the file is still there and still what was recorded
        self._rerecord(restore)
        return go_on and not (enough is not None and enough())

    def _rerecord(self, entries: list[ManifestEntry]) -> None:
        """Record again the entries of files that were not deleted after all."""
        try:
            if entries:
                self.manifest.apply(puts=entries)
        except MirrordError as exc:  # they stay unrecorded: copied and recorded again by a later pass
            self.log.error("prune.rerecord_failed", files=len(entries), reason=exc.reason, cause=exc.cause)

    def _recheck(self, d: Deletion, plan: PrunePlan, report: PruneReport) -> FileState | None:
        """A fresh stat that is still the planned file and that no guard vetoes, else None (reported)."""
        volume = self.primary if d.volume == PRIMARY else self.mirror
        try:
            fresh = volume.stat(d.rel)
        except UnsafePathError:
            self._skip(report, Skipped(d.volume, d.rel, d.step, Veto.NOT_REGULAR, d.state.size))
            return None
        except OSError as exc:
            self._refuse_file(report, d, PruneRefusal.RESTAT_FAILED, exc.strerror or str(exc), failed=True)
            return None
        if fresh is None:
            self._skip(report, Skipped(d.volume, d.rel, d.step, VANISHED, d.state.size))
            return None
        if (fresh.ino, fresh.size, fresh.mtime_ns, fresh.mode) != (
            d.state.ino,
            d.state.size,
            d.state.mtime_ns,
            d.state.mode,
        ):
            self._refuse_file(report, d, CHANGED, "no longer the file that was planned")
            return None
        # The plan's own guards, with a fresh clock, in-flight set and observation of this very file.
        assert plan.guards is not None, "a plan with deletions was vetted by guards"
        ctx = dataclasses.replace(
            plan.guards,
            now=self.wall(),
            in_flight=frozenset(self.in_flight()),
            observed=None
            if self.observations is None
            else {(d.volume, d.rel): self.observations.seen_for(d.volume, fresh)},
        )
        reason = veto(d.volume, fresh, ctx)
        if reason is not None:
            self._skip(report, Skipped(d.volume, d.rel, d.step, reason, fresh.size))
            return None
        return fresh

    def _unlink(self, d: Deletion, fresh: FileState, entry: ManifestEntry | None, report: PruneReport) -> bool:
        """Delete one re-checked file (or dead staging folder); False if it is still there (its entry should be
        recorded again)."""
        volume = self.primary if d.volume == PRIMARY else self.mirror
        try:
            if d.kind != ORPHAN_STAGING:
                volume.delete(d.rel, fresh)
            elif not self.mirror.delete_folder(d.rel, fresh):  # a dead NAME.part/ folder (its writer died)
                raise ChangedError(d.rel, "no longer the folder that was planned")
        except ChangedError as exc:
            self._refuse_file(report, d, CHANGED, exc.cause)
            return True  # it is not the recorded file any more: the entry must not come back
        except MirrordError as exc:
            self._refuse_file(report, d, exc.reason, exc.cause, failed=True)
            return False
        report.deleted.append(d)
        if d.kind != ORPHAN_STAGING:  # (a folder is no pruned file)
            self.metrics.pruned_files.labels(d.volume).inc()
            self.metrics.pruned_bytes.labels(d.volume).inc(fresh.size)
        self.log.info("prune.deleted", manifest_entry=entry is not None, **_fields(d))
        return True

    def _refuse_file(self, report: PruneReport, d: Deletion, reason: str, cause: str, failed: bool = False) -> None:
        (report.failed if failed else report.changed).append((d.volume, d.rel, f"{reason}: {cause}"))
        log = self.log.error if failed else self.log.warning
        log("prune.refused", reason=reason, detail=cause, **_fields(d))
        self.metrics.prune_refusal(reason)
