"""`mirrord run`: the long-running daemon.

    watcher (hints) ─┐
    rescan timer ────┼─> main loop: plan -> JobQueue -> WorkerPool -> Engine (copy, manifest)
    signals (flags) ─┘              └─> Pruner after copies and reconciles; supervisor heartbeat

Signal handlers only set flags and wake the loop; the loop acts. Shutdown is ordered and bounded.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from mirrord import __version__
from mirrord.branches import run_rollbacks
from mirrord.config import Config
from mirrord.engine import Engine
from mirrord.errors import ConfigError, InvalidSourceError, MirrordError
from mirrord.log import get_logger
from mirrord.metrics import Metrics
from mirrord.model import CopyJob, CopyResult, FileState, Snapshot
from mirrord.observe import Observations
from mirrord.plan import SettleTracker, plan_copies
from mirrord.retention import describe_policy, mirror_unmounted
from mirrord.systemd import Notifier
from mirrord.volume import LocalMirror, LocalVolume
from mirrord.watcher import Hint, Watcher, choose_mode, filesystem_type
from mirrord.workers import JobQueue, WorkerPool

# Copy reasons that mean a mirrored file no longer matches its manifest record (checked by stat on every
# reconcile; `mirrord verify` checks content hashes, in its own process, and reports by exit status).
VERIFY_FAILURES = ("mirror_missing", "mirror_mismatch")
# Keys a SIGHUP cannot change: they define what is watched, where it goes, or where we listen.
RESTART_ONLY = ("primary", "mirror", "patterns", "mirror_must_be_mountpoint", "watch.mode", "metrics")


class StartupError(Exception):
    """mirrord cannot start as configured (a busy port, a locked or unreadable mirror)."""


@dataclass
class _Invalid:
    """A source that failed its validator: not retried until it changes; reported after the grace."""

    identity: tuple[int, int, int, int] | None
    since: float  # monotonic: first failure (kept while the file keeps failing)
    status: str
    cause: str
    reported: bool = False


class _Waker:
    """A self-pipe: signal handlers (via set_wakeup_fd) and other threads wake the main loop's select."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._r, selectors.EVENT_READ)

    @property
    def write_fd(self) -> int:
        return self._w.fileno()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._w.send(b"\0")

    def wait(self, timeout: float) -> None:
        if self._selector.select(max(0.0, timeout)):
            with contextlib.suppress(BlockingIOError):
                while self._r.recv(4096):
                    pass

    def close(self) -> None:
        self._selector.close()
        self._r.close()
        self._w.close()


class Daemon:
    def __init__(
        self,
        config: Config,
        reload_config: Callable[[], Config],
        metrics: Metrics | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.reload_config = reload_config
        self.metrics = metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.log = get_logger()
        self.primary = LocalVolume(config.primary)
        self.mirror = LocalMirror(config.mirror)
        self.queue = JobQueue()
        self.settle = SettleTracker(config.copy.settle_seconds, time.time, time.monotonic)
        self.observations = Observations(time.monotonic)  # outlives reloads: the min-age guard needs it
        self._invalid: dict[str, _Invalid] = {}  # written by workers and the loop, under _invalid_lock
        self._invalid_lock = threading.Lock()
        self._rollbacks_logged: set[str] = set()
        self._hints: collections.deque[Hint] = collections.deque()
        self._waker = _Waker()
        self._stop_requests = 0
        self._reload_requested = False
        self._prune_due = False
        self._unsettled: set[str] = set()
        self._verify_failed: set[str] = set()  # main loop adds, workers discard (single set ops)
        self._refused_since_mtime = 0.0  # oldest unmirrored file while the mirror is refused (0: none)
        self._ready = False
        self._health: tuple[bool, str] = (False, "starting")
        self._last_heartbeat = 0.0
        self._next_heartbeat = 0.0
        self._rescan_asked = False  # by a hint drained during a prune pass: done when the pass ends
        self._copied = self._failed = 0
        self._last_error = ""
        self._blocked = ""  # why copying and pruning are refused (e.g. the mirror looks unmounted)
        self.endpoints: Any = None

    # -- probes (called from the HTTP thread) ---------------------------------------------------
    def health(self) -> tuple[bool, str]:
        ok, reason = self._health
        age = time.monotonic() - self._last_heartbeat
        if self._last_heartbeat and age > 3 * self.config.daemon.heartbeat_seconds:
            return False, f"supervisor heartbeat is {age:.0f} s old"
        return ok, reason

    def readiness(self) -> tuple[bool, str]:
        if self._blocked:
            return False, self._blocked
        return (True, "ready") if self._ready else (False, "first reconcile not finished")

    def report(self) -> dict[str, Any]:
        """The /status document: what the daemon is doing right now (copies with their progress)."""
        engine = getattr(self, "engine", None)
        return {
            "version": __version__,
            "ready": self.readiness()[0],
            "queue_depth": self.queue.depth(),
            "copies": [p.to_dict() for p in engine.board.snapshot()] if engine is not None else [],
        }

    # -- signals -------------------------------------------------------------------------------
    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_requests += 1  # NO LOGGING here: just record it; the loop acts.

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self._reload_requested = True

    def _emit(self, hint: Hint) -> None:
        """Called from watcher threads."""
        self._hints.append(hint)
        self._waker.wake()

    def _on_copy_done(self, job: CopyJob, outcome: CopyResult | MirrordError) -> None:
        """Called from worker threads."""
        if isinstance(outcome, CopyResult):
            self._copied += 1
            self._verify_failed.discard(job.rel)
            with self._invalid_lock:
                self._invalid.pop(job.rel, None)
        elif isinstance(outcome, InvalidSourceError):
            # Usually a file still being written: wait until it changes and settles again.
            with self._invalid_lock:
                previous = self._invalid.get(job.rel)
                self._invalid[job.rel] = _Invalid(
                    outcome.identity, previous.since if previous else time.monotonic(), outcome.status,
                    outcome.cause, previous.reported if previous else False)
            # A torn newest step no longer retires the step before it: reconcile, so that one is copied.
            self._rescan_asked = True
        elif outcome.reason != "cancelled":
            self._failed += 1
            self._last_error = f"{job.rel}: {outcome.cause}"
        self._prune_due = True
        self._waker.wake()

    # -- main --------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.config
        self.log.info("daemon.starting", version=__version__, pid=os.getpid(), primary=str(cfg.primary),
                      mirror=str(cfg.mirror), retention=describe_policy(cfg.prune))
        with self.mirror.lock():
            self.manifest = self.mirror.read_manifest()
            self.pruner = self._make_pruner(cfg)
            self.engine = Engine(cfg, self.mirror, self.manifest, self.metrics,
                                 make_room=self.pruner.make_room if self.pruner else None)
            self._start_endpoints()
            previous = self._install_signals()
            try:
                self.pool = WorkerPool(self.engine, self.queue, cfg.copy.workers, self._on_copy_done,
                                       cfg.io.ionice)
                self._start_watcher(cfg)  # before the first scan, so nothing committed in between is missed
                self._loop()
            finally:
                self._shutdown()
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
                signal.set_wakeup_fd(-1)
        self.log.info("daemon.stopped", copied=self._copied, failed=self._failed)
        return 0

    def _start_watcher(self, cfg: Config) -> None:
        fstype = filesystem_type(cfg.primary)
        mode, why = choose_mode(cfg.watch.mode, fstype)
        try:
            self.watcher = Watcher(cfg.primary, cfg.patterns, mode, cfg.watch.poll_interval_seconds, self._emit)
            self.watcher.start()
        except OSError as exc:
            if mode == "polling":
                raise
            # e.g. "inotify watch limit reached" on a big tree: polling is slower but still correct.
            self.log.error("watch.native_failed", cause=exc.strerror or str(exc), fallback="polling",
                           hint="raise fs.inotify.max_user_watches, or set watch.mode = polling")
            with contextlib.suppress(Exception):
                self.watcher.stop()
            mode, why = "polling", f"native watch failed: {exc.strerror or exc}"
            self.watcher = Watcher(cfg.primary, cfg.patterns, mode, cfg.watch.poll_interval_seconds, self._emit)
            self.watcher.start()
        self.metrics.watch_mode.labels(mode).set(1)
        self.log.info("watch.mode", mode=mode, fstype=fstype, why=why)

    def _make_pruner(self, cfg: Config) -> Any:
        if not cfg.prune.enabled:
            return None
        from mirrord.prune import Pruner

        return Pruner(cfg, self.primary, self.mirror, self.manifest, self.metrics, in_flight=self.queue.paths,
                      observations=self.observations, invalid=self._invalid_paths)

    def _invalid_paths(self) -> frozenset[str]:
        with self._invalid_lock:
            return frozenset(self._invalid)

    def _start_endpoints(self) -> None:
        if not self.config.metrics.enabled:
            return
        from mirrord.endpoints import Endpoints

        m = self.config.metrics
        try:
            self.endpoints = Endpoints(m.host, m.port, self.metrics.registry, self.health, self.readiness,
                                       self.report)
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {m.address} (metrics.address): {exc.strerror or exc}"
            ) from exc
        self.endpoints.start()
        self.log.info("metrics.listening", address=f"{m.host}:{self.endpoints.port}",
                      endpoints=["/metrics", "/healthz", "/readyz", "/status"])

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        signal.set_wakeup_fd(self._waker.write_fd, warn_on_full_buffer=False)
        return previous

    def _loop(self) -> None:
        cfg = self.config
        self._reconcile()
        self._ready = True
        self.notifier.ready(self._status())
        self._heartbeat()
        self.log.info("daemon.ready", status=self._status())
        now = time.monotonic()
        next_rescan = now + cfg.watch.rescan_interval_seconds
        next_settle = now + min(0.5, cfg.copy.settle_seconds or 0.5)
        while not self._stop_requests:
            cfg = self.config
            deadlines = [next_rescan, self._next_heartbeat]
            if self._unsettled or self._invalid:
                deadlines.append(next_settle)
            self._waker.wait(min(deadlines) - time.monotonic() if not self._hints else 0)
            if self._stop_requests:
                break
            if self._reload_requested:
                self._reload_requested = False
                self._reload()
            now = time.monotonic()
            if self._drain_hints() or self._rescan_asked or now >= next_rescan:
                self._rescan_asked = False
                self._reconcile()
                next_rescan = time.monotonic() + cfg.watch.rescan_interval_seconds
            if (self._unsettled or self._invalid) and now >= next_settle:
                self._recheck_unsettled()
                next_settle = now + min(0.5, cfg.copy.settle_seconds or 0.5)
            if self._prune_due:
                self._prune_due = False
                self._prune()
            if time.monotonic() >= self._next_heartbeat:
                self._heartbeat()

    # -- reconcile and hints ------------------------------------------------------------------------
    def _reconcile(self) -> None:
        started = time.monotonic()
        psnap = self.primary.snapshot(self.config.patterns)
        msnap = self.mirror.snapshot(self.config.patterns)
        for msg in psnap.errors + msnap.errors:
            self.log.error("scan.error", cause=msg)
        for rel, why in psnap.skipped:
            self.log.warning("scan.skipped", path=rel, why=why, volume="primary")
        if self._mirror_looks_unmounted(msnap):
            # Nothing is queued while the mirror is refused, yet it falls behind: keep lag honest.
            pending = plan_copies(psnap, msnap, self.manifest.entries, self.config.step_regex).jobs
            self._refused_since_mtime = min((j.mtime_ns / 1e9 for j in pending if j.mtime_ns > 0), default=0.0)
            return
        self._refused_since_mtime = 0.0
        self._log_rollbacks(psnap)
        # Prune first: its plan tells the copy planner which old steps retention has retired.
        self._prune(psnap, msnap)
        queued = self._enqueue(psnap, msnap)
        self.metrics.reconcile_duration.set(time.monotonic() - started)
        self.log.info("reconcile.finished", primary_files=len(psnap.files), mirror_files=len(msnap.files),
                      queued=queued, unsettled=len(self._unsettled),
                      seconds=round(time.monotonic() - started, 3))

    def _log_rollbacks(self, psnap: Snapshot) -> None:
        """Once per run: the trainer went back to a lower step (its new checkpoints are mirrored)."""
        lie = (time.time() + self.config.prune.future_skew_seconds) * 1e9
        for run, rollbacks in run_rollbacks(psnap.files.values(), self.config.step_regex, lie).items():
            if run not in self._rollbacks_logged:
                self._rollbacks_logged.add(run)
                old, new = rollbacks[-1]
                self.log.warning("run.rollback_detected", run=run or ".", old_step=old, new_step=new,
                                 rollbacks=len(rollbacks))

    def _mirror_looks_unmounted(self, msnap: Snapshot) -> bool:
        is_mount = self.config.mirror.is_mount() if self.config.mirror_must_be_mountpoint else None
        problem = mirror_unmounted(msnap, self.manifest.entries, is_mount)
        if (problem or "") != self._blocked:
            if problem:
                self.log.error("mirror.refused", cause=problem, mirror=str(self.config.mirror))
            else:
                self.log.info("mirror.accepted", mirror=str(self.config.mirror))
        self._blocked = problem or ""
        return bool(problem)

    def _enqueue(self, psnap: Snapshot, msnap: Snapshot, partial: bool = False) -> int:
        plan = plan_copies(psnap, msnap, self.manifest.entries, self.config.step_regex,
                           self.settle.at(time.monotonic()))
        # Steps retention already pruned would only be pruned again (prune.primary = false keeps them).
        retired = self.pruner.retired if self.pruner is not None else (lambda run, step, mtime_ns: False)
        queued = 0
        for job in plan.jobs:
            with self._invalid_lock:
                invalid = self._invalid.get(job.rel)
            src = psnap.files.get(job.rel)
            if invalid is not None and src is not None and src.identity == invalid.identity:
                continue  # judged invalid as it is now; retried once it changes and settles again
            if retired(job.run, job.step, job.mtime_ns) or not self.queue.put(job):
                continue
            queued += 1
            if job.why in VERIFY_FAILURES and job.rel not in self._verify_failed:
                # The manifest vouches for a copy that is gone or no longer what was recorded: count it
                # once per damage (until a fresh copy is recorded), then repair it by copying again.
                self._verify_failed.add(job.rel)
                self.metrics.verify_failures.inc()
                self.log.warning("mirror.verify_failed", path=job.rel, run=job.run or ".", step=job.step,
                                 why=job.why)
        if partial:
            self._unsettled.update(plan.unsettled)
            self._unsettled.difference_update(j.rel for j in plan.jobs)
        else:
            self._unsettled = set(plan.unsettled)
        return queued

    def _drain_hints(self) -> bool:
        """Handle queued watcher hints; returns True when a full rescan was asked for."""
        files: dict[str, FileState] = {}
        rescan = False
        while self._hints:
            hint = self._hints.popleft()
            if hint.rescan:
                rescan = True
                continue
            try:
                state = self.primary.stat(hint.rel)
            except (OSError, ValueError):
                continue
            if state is None or not state.is_regular:
                continue
            if hint.committed:
                self.settle.mark_committed(state)
            files[hint.rel] = state
        if rescan:
            self.log.warning("watch.rescan", why="event queue overflow or directory move")
            return True
        if files and not self._blocked:
            self._enqueue_paths(files)
        return False

    def _enqueue_paths(self, files: dict[str, FileState]) -> None:
        mirror_files: dict[str, FileState] = {}
        for rel in files:
            state = self.mirror.stat(rel)
            if state is not None:
                mirror_files[rel] = state
        self._enqueue(Snapshot(files), Snapshot(mirror_files), partial=True)

    def _recheck_unsettled(self) -> None:
        files: dict[str, FileState] = {}
        with self._invalid_lock:
            invalid = set(self._invalid)
        for rel in self._unsettled | invalid:
            try:
                state = self.primary.stat(rel)
            except (OSError, ValueError):
                state = None
            if state is None or not state.is_regular:
                self._unsettled.discard(rel)
                with self._invalid_lock:
                    self._invalid.pop(rel, None)
                self.settle.forget(rel)
            else:
                files[rel] = state
        if files:
            self._enqueue_paths(files)

    # -- retention ----------------------------------------------------------------------------------
    def _prune(self, psnap: Snapshot | None = None, msnap: Snapshot | None = None) -> None:
        if self.pruner is None or self._blocked:
            return
        try:
            self.pruner.run_cycle(psnap, msnap, keep_going=self._between_deletions)
        except MirrordError as exc:
            self.log.error("prune.failed", reason=exc.reason, path=exc.path, cause=exc.cause)

    def _between_deletions(self) -> bool:
        """A long prune pass keeps the daemon alive: new checkpoints are queued (workers copy meanwhile),
        the heartbeat (WATCHDOG=1, /healthz) goes on, and a stop request ends the pass."""
        if self._hints and self._drain_hints():
            self._rescan_asked = True
        if time.monotonic() >= self._next_heartbeat:
            self._heartbeat()
        return not self._stop_requests

    # -- supervision ------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        cfg = self.config
        problems = self.pool.check_stalls(cfg.copy.stall_seconds)
        self.pool.report_progress()
        if not self.watcher.is_alive():
            problems.append("filesystem watcher stopped")
        self._health = (not problems, "; ".join(problems) or "ok")
        self._last_heartbeat = time.monotonic()
        self._next_heartbeat = self._last_heartbeat + cfg.daemon.heartbeat_seconds
        self._report_invalid()
        self._update_gauges()
        status = self._status()
        if problems:
            self.log.error("daemon.unhealthy", problems=problems)
            self.notifier.status("UNHEALTHY: " + "; ".join(problems))
        else:
            self.notifier.watchdog(status)

    def _report_invalid(self) -> None:
        """A source still invalid after copy.invalid_grace_seconds is not being written: say so once."""
        grace, now = self.config.copy.invalid_grace_seconds, time.monotonic()
        with self._invalid_lock:
            items = list(self._invalid.items())
        for rel, invalid in items:
            if not invalid.reported and now - invalid.since >= grace:
                invalid.reported = True
                self.metrics.copy_result("invalid_source")
                self.log.error("copy.invalid_source", path=rel, reason=invalid.status, cause=invalid.cause,
                               seconds_invalid=round(now - invalid.since, 1), published=False)
        self.metrics.invalid_sources.set(sum(i.reported for _, i in items))

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self.queue.depth())
        for name, volume in (("primary", self.primary), ("mirror", self.mirror)):
            try:
                free, total = volume.space()
            except OSError:
                continue
            self.metrics.free_bytes.labels(name).set(free)
            self.metrics.total_bytes.labels(name).set(total)
        now_wall, now_mono = time.time(), time.monotonic()
        lag = 0.0
        for entry in self.queue.pending():
            mtime = entry.job.mtime_ns / 1e9
            by_mtime = now_wall - mtime if 0 < mtime <= now_wall else 0.0
            lag = max(lag, by_mtime, now_mono - entry.first_seen)
        if self._blocked and self._refused_since_mtime:
            lag = max(lag, now_wall - self._refused_since_mtime)
        self.metrics.lag.set(lag)

    def _status(self) -> str:
        status = (f"{self._copied} copied, {self._failed} failed, queue {self.queue.depth()}, "
                  f"unsettled {len(self._unsettled)}, invalid {len(self._invalid)}")
        if self._blocked:
            status += f"; REFUSED: {self._blocked}"
        elif self._last_error:
            status += f"; last error: {self._last_error}"
        return status

    # -- reload and shutdown ------------------------------------------------------------------------
    def _reload(self) -> None:
        self.notifier.reloading()
        try:
            new = self.reload_config()
        except ConfigError as exc:
            self.log.error("config.reload_failed", problems=exc.problems)
            self.notifier.status(self._status())
            return
        old_data, new_data = self.config.to_toml_dict(), new.to_toml_dict()
        fixed = [k for k in RESTART_ONLY if _get(old_data, k) != _get(new_data, k)]
        if fixed:
            self.log.error("config.reload_refused", keys=fixed, why="these keys need a restart")
            self.notifier.status(self._status())
            return
        self.config = new
        self.engine.reconfigure(new)
        self.pool.resize(new.copy.workers)
        self.settle.settle_seconds = new.copy.settle_seconds
        self.pruner = self._make_pruner(new)
        self.engine.make_room = self.pruner.make_room if self.pruner else None
        from mirrord import log as logsetup

        logsetup.configure(new.log.format, new.log.level)
        self.log = get_logger()
        self.log.info("config.reloaded", workers=new.copy.workers, keep_last=new.prune.keep_last,
                      prune_enabled=new.prune.enabled)
        self.notifier.ready(self._status())

    def _shutdown(self) -> None:
        cfg = self.config
        self.notifier.stopping()
        pool: WorkerPool | None = getattr(self, "pool", None)
        self.log.info("daemon.stopping", in_flight=len(pool.active_controls()) if pool else 0,
                      grace_seconds=cfg.daemon.shutdown_grace_seconds)
        if getattr(self, "watcher", None) is not None:
            with contextlib.suppress(Exception):
                self.watcher.stop()
        if pool is not None and not pool.stop(cfg.daemon.shutdown_grace_seconds,
                                              force=lambda: self._stop_requests > 1):
            self.log.error("daemon.copies_not_stopped", why="a copy is stuck in the kernel (hung mount?)")
        self._close_manifest()
        if self.endpoints is not None:
            self.endpoints.stop()
        self._waker.close()
        self.notifier.close()


    def _close_manifest(self) -> None:
        """Fold the journal into the snapshot; if that fails the journal is simply replayed next start."""
        manifest = getattr(self, "manifest", None)
        if manifest is None:
            return
        try:
            manifest.close()
        except MirrordError as exc:
            self.log.error("manifest.compaction_failed", path=exc.path, cause=exc.cause)


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def run_daemon(config: Config, reload_config: Callable[[], Config]) -> int:
    """Run until SIGTERM/SIGINT; raises StartupError when it cannot start as configured."""
    return Daemon(config, reload_config).run()
