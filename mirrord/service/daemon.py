"""`mirrord run`: the long-running daemon, a lifecycle shell around its collaborators.

    watcher (hints) ─┐
    rescan timer ────┼─> Inbox -> main loop: Reconciler -> JobQueue -> WorkerPool -> Engine (copy, manifest)
    signals (flags) ─┘              └─> Pruner after copies and reconciles; Drills after copies; Supervisor heartbeat

Signal handlers only set flags and wake the loop; the loop acts. Everything the daemon derives from its
config is one Settings object that a reload swaps. Shutdown is ordered and bounded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from mirrord.config import DAY, Config
from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.core.observe import Observations
from mirrord.core.plan import SettleTracker
from mirrord.core.retention import Sightings
from mirrord.errors import ConfigError, MirrordError, SourceChangedError, TransientError
from mirrord.obs import log as logsetup
from mirrord.obs.metrics import Metrics
from mirrord.service.clock import SYSTEM_CLOCK, Clock
from mirrord.service.drills import Drills
from mirrord.service.endpoints import serve
from mirrord.service.engine import Engine
from mirrord.service.inbox import Inbox
from mirrord.service.jobqueue import JobQueue
from mirrord.service.ledger import Ledger
from mirrord.service.pacing import Pacer, missing_evidence, save_interval
from mirrord.service.pruner import Pruner
from mirrord.service.reconciler import Reconciler
from mirrord.service.refusals import Refusals
from mirrord.service.reload import reload_refusal
from mirrord.service.scrub import Scrubber
from mirrord.service.settings import Settings
from mirrord.service.signals import SignalFlags
from mirrord.service.supervisor import Supervisor
from mirrord.service.systemd import Notifier
from mirrord.service.watcher import Hint, PrimaryWatch, Watcher, WatcherFactory
from mirrord.service.workers import WorkerPool
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.volume import LocalVolume, exclude_each_other


@dataclass(frozen=True)
class Volumes:
    """The primary, the mirror, and the mirror's manifest (read while holding the mirror's lock)."""

    primary: LocalVolume
    mirror: Mirror
    manifest: Manifest


class Daemon:
    """Builds its collaborators from `config` and `volumes`, then runs them: start, loop, reload, shutdown."""

    def __init__(
        self,
        config: Config,
        reload_config: Callable[[], tuple[Config, bool]],
        volumes: Volumes,
        *,
        queue: JobQueue | None = None,
        watcher_factory: WatcherFactory = Watcher,
        clock: Clock = SYSTEM_CLOCK,
        metrics: Metrics | None = None,
        notifier: Notifier | None = None,
        signals: SignalFlags | None = None,
    ) -> None:
        self.reload_config, self.clock = reload_config, clock
        self._draining, self._stopped_by_supervisor = 0, False  # see _drain
        self.signals, self.metrics = signals or SignalFlags(), metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.primary, self.mirror, self.manifest = volumes.primary, volumes.mirror, volumes.manifest
        self.queue = queue or JobQueue(clock.monotonic)
        self.log = logsetup.get_logger()
        self.inbox = Inbox()
        self.refusals = Refusals(str(config.mirror_target))
        self.ledger = Ledger(self.metrics, self.refusals, clock.monotonic, clock.wall)
        self.metrics.live.read(
            queue_depth=self.queue.depth,
            lag_seconds=lambda: self.ledger.lag(self.queue.pending()),
            held=lambda: self.settings.pruner.held if self.settings.pruner else (0, {}),
        )
        self.metrics.mirror_writable.set_function(lambda: 0.0 if self.mirror.write_problem() else 1.0)
        self.observations = Observations(clock.monotonic)  # outlives reloads: the min-age guard needs it
        # What this process copies from here on, it saw on the primary (follow mode's evidence of rotation).
        self.observations.sightings = Sightings(since=self.manifest.last_seq)
        self.settle = SettleTracker(config.copy.settle_seconds, clock.wall, clock.monotonic)
        self.settings = Settings.derive(config, self.notifier.watchdog_seconds, self._pruner)
        self.engine = Engine(config, self.mirror, self.manifest, self.metrics, wall=clock.wall)
        self._interval: tuple[float, float | None] = (-DAY, None)  # (when found, the runs' save interval)
        self.pacer = Pacer(self._behind, self.metrics, config.io.cpu_policy != "idle") if config.io.pacing else None
        self.drills = Drills(self.mirror, self.manifest, self.metrics, clock.wall, self.inbox.wake)
        self.endpoints = serve(
            config.metrics,
            self.metrics.registry,
            lambda: self.supervisor.health(),
            lambda: self.supervisor.readiness(),
            lambda: self.supervisor.report() | {"drills": self.drills.report()},
        )
        self.pool = WorkerPool(
            self.engine.stage,
            self.queue,
            config.copy_workers,
            commit=self.engine.commit,
            retry=self.settings.retry,
            on_done=self._on_copy_done,
            on_stalled=lambda job: self.metrics.copy_result("stalled"),
            clock=clock.monotonic,
            ionice=config.io.ionice,
            cpu_nice=config.io.cpu_nice,
            cpu_policy=config.io.cpu_policy,
            pacer=self.pacer,
        )
        self._swap(self.settings)
        self.watch = PrimaryWatch(
            lambda: self.settings.config, self.primary.key, self.inbox.post, self.metrics, watcher_factory
        )
        self.reconciler = Reconciler(
            settings=lambda: self.settings,
            primary=self.primary,
            mirror=self.mirror,
            manifest=self.manifest,
            queue=self.queue,
            ledger=self.ledger,
            refusals=self.refusals,
            inbox=self.inbox,
            settle=self.settle,
            observations=self.observations,
            metrics=self.metrics,
            heartbeat=lambda: self.supervisor.beat_if_due(),
            stopping=lambda: self.signals.stop_requests > self._draining,
            wall=clock.wall,
            monotonic=clock.monotonic,
        )
        self.supervisor = Supervisor(
            settings=lambda: self.settings,
            pool=self.pool,
            board=self.engine.board,
            queue=self.queue,
            primary=self.primary,
            mirror=self.mirror,
            manifest=self.manifest,
            refusals=self.refusals,
            ledger=self.ledger,
            watch=self.watch,
            metrics=self.metrics,
            notifier=self.notifier,
            status=self.status,
            stop=self._stop,
            monotonic=clock.monotonic,
        )
        self.scrubber = Scrubber(
            lambda: self.settings.config,
            self.mirror,
            self.manifest,
            self.metrics,
            in_flight=self.queue.paths,
            busy=lambda: bool(self.queue.paths()) or bool(self.refusals.blocked),
            repair=self._repair,
            wall=clock.wall,
            pacer=self.pacer,
        )

    def _pruner(self, config: Config) -> Pruner:
        return Pruner(
            config,
            self.primary,
            self.mirror,
            self.manifest,
            self.metrics,
            in_flight=self.queue.paths,
            observations=self.observations,
            invalid=self.ledger.invalid_files,
        )

    # -- status and callbacks from other threads --------------------------------------------------
    def status(self) -> str:
        """The one-line status for systemd and the log."""
        return self.ledger.status(self.queue.depth(), len(self.reconciler.unsettled))

    def _on_copy_done(self, job: CopyJob, outcome: CopyResult | MirrordError) -> None:
        if self.ledger.record(job, outcome):
            self.inbox.rescan_asked = True
        if job.members and isinstance(outcome, SourceChangedError):  # judged again from a fresh listing
            self.inbox.post(Hint(job.rel, committed=False))
        self.inbox.ask_prune()

    def _repair(self, job: CopyJob) -> None:
        """A copy the scrub found damaged, copied again from the primary that still holds its bytes (not while
        the mirror is refused: the next pass asks again)."""
        if not self.refusals.blocked and self.queue.put(dataclasses.replace(job, seen=self.manifest.last_seq)):
            self.ledger.damaged(job)

    def _behind(self) -> bool:
        """The mirror lags by more than one save interval (the pacer's floor share is due); the interval is
        found again from the manifest once a minute."""
        found, interval = self._interval
        if self.clock.monotonic() - found >= 60:
            self._interval = found, interval = self.clock.monotonic(), save_interval(self.manifest.entries.values())
        return interval is not None and self.ledger.lag(self.queue.pending()) > interval

    def _stop(self) -> None:
        self._stopped_by_supervisor = True  # (the mirror's lock lost, a worker wedged): nothing is drained
        self.signals.stop_requests += 1
        self.inbox.wake()

    # -- lifecycle ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Start, loop until a stop signal (or a lost lock), shut down; the exit status."""
        self.signals.install()
        self.signals.wake_through(self.inbox.write_fd)
        try:
            self.start()
            while not self.signals.stop_requests:
                self.tick()
        finally:
            self.shutdown()
        return self.supervisor.exit_code

    def start(self) -> None:
        """Serve the probes, watch (before the first listing, so nothing committed meanwhile is missed),
        reconcile once, then report ready."""
        if self.endpoints is not None:
            self.endpoints.start()
            self.log.info(
                "metrics.listening",
                address=f"{self.settings.config.metrics.host}:{self.endpoints.port}",
                endpoints=["/metrics", "/healthz", "/readyz", "/status"],
            )
        if not self._await_primary(self.notifier.ready):
            return
        self.watch.start()
        if self.signals.stop_requests:
            return
        self.reconciler.start()
        self.supervisor.ready = True
        self.notifier.ready(self.status())
        self.supervisor.heartbeat()
        self.scrubber.start()
        config = self.settings.config
        mirror = self.mirror.local_tree()
        missing = missing_evidence([self.primary.root] + ([mirror.root] if mirror else []), config.io.ionice)
        if missing and config.io.pacing:
            self.log.warning("pacing.evidence_missing", missing=missing, docs="docs/performance.md#pacing")
        self.log.info("daemon.ready", status=self.status())

    def _await_primary(self, announce: Callable[[str], None]) -> bool:
        """A missing primary root (a disk being replaced, a mount not there yet, or gone while running) is
        a state, not an error: systemd hears READY=1 (or STATUS=) and the watchdog stays fed, /readyz says
        what is awaited, nothing is listed (so nothing is pruned because the primary looks empty), and
        mirroring begins on the first heartbeat that finds the root. False when a stop came first."""
        if self.primary.exists():
            return True
        was_ready, self.supervisor.ready = self.supervisor.ready, False
        self.supervisor.waiting = f"primary root {self.primary.root} does not exist; waiting for it"
        self.log.warning("primary.missing", path=str(self.primary.root), action="mirroring begins when it appears")
        announce(self.supervisor.waiting)
        while not self.signals.stop_requests and not self.primary.exists():
            self.supervisor.heartbeat()
            self.inbox.wait(self.supervisor.next_due - self.clock.monotonic())
            if self.signals.reload_requested:
                self.signals.reload_requested = False
                self.reload()
        self.supervisor.waiting = None
        exclude_each_other(self.primary, self.mirror)
        self.log.info("primary.found", path=str(self.primary.root))
        self.supervisor.ready = was_ready
        return not self.signals.stop_requests

    def tick(self, wait: bool = True) -> None:
        """One turn of the loop: sleep until the next deadline or a wake-up (unless `wait` is False),
        then do what is due: a reload, the reconciler's work, a drill once the copies are done, the heartbeat."""
        deadline = min(self.reconciler.next_deadline(), self.supervisor.next_due)
        self.inbox.wait(deadline - self.clock.monotonic() if wait else 0)
        if self.signals.stop_requests:
            return
        if self.signals.reload_requested:
            self.signals.reload_requested = False
            self.reload()
        if not self._await_primary(self.notifier.status):
            return
        try:
            self.reconciler.work()
        except TransientError as exc:  # a storage blip on any path: said, and the next rescan tries again
            self.log.error("daemon.storage_unavailable", path=exc.path, cause=exc.cause, action="retry at next rescan")
        # (a path stays the queue's until its copy is recorded: the manifest's last_seq, which the drill reads, is
        # given before a record lands)
        busy = self.reconciler.unsettled or self.queue.paths()
        self.drills.start_due(self.settings.config, idle=not busy and not self.refusals.blocked)
        self.supervisor.beat_if_due()

    def reload(self) -> None:
        """SIGHUP: read the config again; swap the settings unless reload_refusal() objects."""
        self.notifier.reloading()
        try:
            new, stable = self.reload_config()
        except ConfigError as exc:
            self.log.error("config.reload_failed", problems=exc.problems)
            return self.notifier.status(self.status())
        refusal = reload_refusal(self.settings.config, new, stable)
        if refusal is not None:
            self.log.error("config.reload_refused", keys=refusal.keys, why=refusal.why)
            return self.notifier.status(self.status())
        self._swap(Settings.derive(new, self.notifier.watchdog_seconds, self._pruner))
        logsetup.configure(new.log.format, new.log.level)
        self.log = logsetup.get_logger()
        self.log.info(
            "config.reloaded", workers=new.copy_workers, keep_last=new.prune.keep_last, prune_enabled=new.prune.enabled
        )
        self.notifier.ready(self.status())

    def _swap(self, settings: Settings) -> None:
        """Put `settings` in force everywhere at once (the parts that keep their own copy are told here)."""
        self.settings = settings
        self.engine.reconfigure(settings.config, settings.pruner.make_room if settings.pruner else None)
        self.pool.resize(settings.config.copy_workers)
        self.queue.keep_lane_for_small(settings.config.copy.small_file_bytes, settings.config.copy_workers)
        self.pool.retry = settings.retry
        self.settle.settle_seconds = settings.config.copy.settle_seconds
        self.settle.unit_seconds = settings.config.unit.settle_seconds

    def _drain(self, deadline: float) -> None:
        """A stop drains what is settled: one last listing (no prune) finds what no event reported yet; files
        still settling get the rest of their settle time and everything queued is copied, until `deadline`
        (or a second signal). Whatever is still not mirrored then is named (stop.left_behind)."""
        self._draining = 1  # the first stop request lets the reconciler list and queue; a second one does not
        self.settings = dataclasses.replace(self.settings, pruner=None)  # a stop prunes nothing
        self.inbox.rescan_asked = True
        while self.signals.stop_requests < 2:
            try:
                self.reconciler.work()
            except MirrordError as exc:
                self.log.error("stop.drain_failed", path=exc.path, cause=exc.cause)
                break
            now = self.clock.monotonic()
            if now >= deadline or not (self.reconciler.unsettled or self.queue.depth() or self.pool.active_controls()):
                break
            self.inbox.wait(min(self.reconciler.next_deadline(), deadline, now + 0.2) - now)
        self._draining = 0
        for rel in sorted(self.reconciler.unsettled | {q.job.rel for q in self.queue.pending()}):
            self.log.warning(
                "stop.left_behind",
                path=rel,
                why="not settled and copied within the stop's grace "
                "period (daemon.shutdown_grace_seconds); the next start copies it",
            )

    def shutdown(self) -> None:
        """Stop watching, let copies finish within the grace period (a second signal cuts it short),
        fold the manifest's journal, stop serving; bounded whatever the copies do."""
        cfg = self.settings.config
        self.notifier.stopping()
        self.log.info(
            "daemon.stopping",
            in_flight=len(self.pool.active_controls()),
            grace_seconds=cfg.daemon.shutdown_grace_seconds,
        )
        deadline = self.clock.monotonic() + cfg.daemon.shutdown_grace_seconds
        self.watch.close()
        self.scrubber.stop()
        self.drills.stop()
        if self.supervisor.ready and not self._stopped_by_supervisor:
            self._drain(deadline)
        if not self.pool.stop(
            max(0.0, deadline - self.clock.monotonic()),
            force=lambda: self.signals.stop_requests > 1,
            why=f"shutdown grace period ({cfg.daemon.shutdown_grace_seconds:g} s) over",
        ):
            self.log.error("daemon.copies_not_stopped", why="a copy is stuck in the kernel (hung mount?)")
        try:  # folds the journal into the snapshot; if that fails the journal is replayed next start
            self.manifest.close()
        except MirrordError as exc:
            self.log.error("manifest.compaction_failed", path=exc.path, cause=exc.cause)
        if self.endpoints is not None:
            self.endpoints.stop()
        self.inbox.close()
        self.notifier.close()
