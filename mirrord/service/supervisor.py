"""The daemon's heartbeat: every `ping_every` seconds it checks the workers (stalls), the mirror (still
the pinned volume, manifest still ours, lock still held) and the watcher, reports what is invalid or
lagging, and tells systemd (WATCHDOG=1, or the problems). It also answers the HTTP probes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from structlog.typing import FilteringBoundLogger

from mirrord import __version__
from mirrord.errors import MirrordError
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.service.jobqueue import JobQueue
from mirrord.service.ledger import Ledger
from mirrord.service.progress import ProgressBoard, log_progress
from mirrord.service.refusals import IDENTITY, LEASE, MANIFEST, Refusals
from mirrord.service.settings import Settings
from mirrord.service.systemd import Notifier
from mirrord.service.watcher import PrimaryWatch
from mirrord.service.workers import WorkerPool
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.volume import LocalVolume

# /status field -> the metric (without mirrord_) that says it
STATUS_METRICS = {
    "in_flight": "copies_in_flight",
    "lag_seconds": "mirror_lag_seconds",
    "invalid_sources": "invalid_sources",
    "copy_loops": "copy_loop_files",
    "manifest_repairs": "manifest_repairs_total",
    "last_copy_at": "last_mirrored_timestamp_seconds",
}


@dataclasses.dataclass(eq=False, kw_only=True)
class Supervisor:
    """Health, readiness and the heartbeat; `stop()` is asked when the mirror lock is lost."""

    settings: Callable[[], Settings]
    pool: WorkerPool
    board: ProgressBoard
    queue: JobQueue
    primary: LocalVolume
    mirror: Mirror
    manifest: Manifest
    refusals: Refusals
    ledger: Ledger
    watch: PrimaryWatch
    metrics: Metrics
    notifier: Notifier
    status: Callable[[], str]
    stop: Callable[[], None]
    monotonic: Callable[[], float]
    ready: bool = False
    waiting: str | None = None  # what the daemon waits for before it starts (a missing primary root)
    exit_code: int = 0
    next_due: float = 0.0
    log: FilteringBoundLogger = dataclasses.field(default_factory=get_logger, init=False)
    _health = (False, "starting")  # (not fields: the heartbeat sets them)
    _last = 0.0

    # -- probes (called from the HTTP thread) ---------------------------------------------------
    def health(self) -> tuple[bool, str]:
        """/healthz: the last heartbeat's verdict, or unhealthy if heartbeats stopped. A lease that is not
        safe to publish under is read here too, at once: the heartbeat may be held up by the same store."""
        paused = self.mirror.write_problem()
        if paused:
            return False, paused
        ok, reason = self._health
        age = self.monotonic() - self._last
        if self._last and age > 3 * self.settings().config.daemon.heartbeat_seconds:
            return False, f"supervisor heartbeat is {age:.0f} s old"
        return ok, reason

    def readiness(self) -> tuple[bool, str]:
        """/readyz: ready once the first reconcile finished, while nothing is refused."""
        if self.refusals.blocked:
            return False, self.refusals.blocked
        return (True, "ready") if self.ready else (False, self.waiting or "first reconcile not finished")

    def report(self) -> dict[str, Any]:
        """The /status document, all that `mirrord status` asks the daemon: which roots it mirrors (status
        checks it asks the right one), its health and readiness, its counters, and the copies under way
        with their progress."""
        samples = [s for family in self.metrics.registry.collect() for s in family.samples]
        plain = {s.name.removeprefix("mirrord_"): s.value for s in samples if not s.labels}
        (healthy, health), (ready, readiness) = self.health(), self.readiness()
        return {
            "version": __version__,
            "primary": self.primary.describe(),
            "mirror": self.mirror.describe(),
            "healthy": healthy,
            "health": health,
            "ready": ready,
            "readiness": readiness,
            "queue_depth": self.queue.depth(),
            **{field: plain.get(metric) for field, metric in STATUS_METRICS.items()},
            "copies_by_result": {s.labels["result"]: s.value for s in samples if s.name == "mirrord_copies_total"},
            "copies": [p.to_dict() for p in self.board.snapshot()],
        }

    # -- the heartbeat ------------------------------------------------------------------------------
    def beat_if_due(self) -> None:
        """The heartbeat, if it is due."""
        if self.monotonic() >= self.next_due:
            self.heartbeat()

    def heartbeat(self) -> None:
        """Check everything once; tell systemd."""
        settings = self.settings()
        cfg = settings.config
        problems = self.pool.check_stalls(cfg.copy.stall_seconds)
        log_progress(self.board, self.log)
        self._check_mirror()
        # (An unmounted mirror takes its lock file along: that is a refusal, handled above.)
        lost = None if self.refusals.get(IDENTITY) else self.mirror.lock_problem()
        if lost:
            self.log.error("mirror.lock_lost", cause=lost, action="stopping")
            self.exit_code = 1
            self.stop()
        paused = self.mirror.write_problem()
        self.refusals.refuse(LEASE, paused)  # no new copies or prunes; in-flight commits refuse on their own
        if paused:
            problems.append(paused)
        if self.waiting is None:  # (nothing to watch yet while the primary root is awaited)
            problems += self.watch.check()
        self._health = (not problems, "; ".join(problems) or "ok")
        self._last = self.monotonic()
        self.next_due = self._last + settings.ping_every
        self.ledger.report_invalid(cfg.copy.invalid_grace_seconds)
        self._update_gauges()
        status = self.status()
        if problems:
            self.log.error("daemon.unhealthy", problems=problems)
            self.notifier.status("UNHEALTHY: " + "; ".join(problems))
        elif self.ready or self.waiting:
            self.notifier.watchdog(self.waiting or status)
        else:  # a beat inside the first pass (/healthz stays fresh): systemd hears READY=1 first
            self.notifier.status(status)

    def _check_mirror(self) -> None:
        """Is the mirror still the pinned volume, and is its manifest still ours (repaired if not)?"""
        self.refusals.refuse(IDENTITY, self.mirror.identity_problem())
        if self.refusals.get(IDENTITY):
            return
        damage = self.manifest.disk_problem()
        problem = None
        if damage is not None:
            try:
                self.manifest.compact()  # a new snapshot of every entry and a fresh journal
            except MirrordError as exc:
                problem = (
                    f"{damage}; cannot repair it: {exc.cause}; fix the path, or stop mirrord and run "
                    "`mirrord repair-manifest`"
                )
            else:
                self.metrics.manifest_repairs.inc()
                self.log.error("manifest.repaired", cause=damage, entries=len(self.manifest))
        self.refusals.refuse(MANIFEST, problem)  # (clearing an absent refusal logs nothing)

    def _update_gauges(self) -> None:
        """Free space is read on the heartbeat (statvfs may hang on a dead mount: never in a scrape);
        queue depth and lag are read by each scrape (mirrord.obs.metrics.LiveState)."""
        for name, volume in (("primary", self.primary), ("mirror", self.mirror)):
            if name == "mirror" and self.refusals.get(IDENTITY):
                continue  # that would be the free space of whatever is under the mount point
            try:
                space = volume.space()
            except OSError:
                continue
            if space is not None:
                self.metrics.free_bytes.labels(name).set(space[0])
                self.metrics.total_bytes.labels(name).set(space[1])
