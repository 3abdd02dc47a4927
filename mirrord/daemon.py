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
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mirrord import __version__
from mirrord.branches import run_rollbacks
from mirrord.config import Config, risky_changes
from mirrord.engine import Engine
from mirrord.errors import ConfigError, InvalidSourceError, MirrordError
from mirrord.guards import RECENTLY_SEEN
from mirrord.identity import MirrorGoneError
from mirrord.log import get_logger
from mirrord.metrics import Metrics
from mirrord.model import CopyJob, CopyResult, FileState, ManifestEntry, Snapshot
from mirrord.observe import Observations
from mirrord.plan import SettleTracker, plan_copies, why_copy
from mirrord.retention import describe_policy, mirror_unmounted
from mirrord.signals import SignalFlags
from mirrord.systemd import Notifier, ping_interval
from mirrord.volume import LocalMirror, LocalVolume
from mirrord.watcher import Hint, Watcher, choose_mode, filesystem_type
from mirrord.workers import JobQueue, WorkerPool

# Copy reasons that mean a mirrored file no longer matches its manifest record (checked by stat on every
# reconcile; `mirrord verify` checks content hashes, in its own process, and reports by exit status).
VERIFY_FAILURES = ("mirror_missing", "mirror_mismatch")
# Keys a SIGHUP cannot change: they define what is watched, where it goes, or where we listen.
RESTART_ONLY = ("primary", "mirror", "patterns", "mirror_must_be_mountpoint", "watch.mode", "metrics")
# A file re-copied this many times for the same source (size, mtime) with the same outcome is a
# problem to report (status, metrics), not a job: copying it again would loop forever.
RECOPY_LIMIT = 3
# Refusal sources: the mirror is not the pinned volume; it looks unmounted; its manifest is unwritable.
IDENTITY, LISTING, MANIFEST = "identity", "listing", "manifest"


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
        reload_config: Callable[[], tuple[Config, bool]],
        metrics: Metrics | None = None,
        notifier: Notifier | None = None,
        signals: SignalFlags | None = None,
    ) -> None:
        self.config = config
        self.reload_config = reload_config
        self.signals = signals or SignalFlags()
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
        self._prune_due = False
        # When deletions wait only for our own observation (the min-age guard's monotonic clock), the
        # next pass is due when that observation matures, not at the next rescan.
        self._prune_at: float | None = None
        self._unsettled: set[str] = set()
        self._verify_failed: set[str] = set()  # main loop adds, workers discard (single set ops)
        # Committed primary files not yet mirrored -> since when (wall clock): the lag, whatever the
        # queue holds (a job dropped after a permanent error is still behind). Workers remove.
        self._unmirrored: dict[str, float] = {}
        self._unmirrored_lock = threading.Lock()
        self._recopies: dict[str, tuple[tuple[int, int], int]] = {}  # rel -> (source key, re-copies)
        self._looping: set[str] = set()
        self._ready = False
        self._health: tuple[bool, str] = (False, "starting")
        self._last_heartbeat = 0.0
        self._ping_every = config.daemon.heartbeat_seconds  # WATCHDOG=1 period; see _ping_interval
        self._next_heartbeat = 0.0
        self._rescan_asked = False  # by a hint drained during a prune pass: done when the pass ends
        self._copied = self._failed = 0
        self._last_error = ""
        self._exit_code = 0
        self._refusals: dict[str, str] = {}  # source -> why copying and pruning are refused
        self._refusals_logged: dict[str, str] = {}
        self._watch_key: tuple[int, int] | None = None
        self.watcher: Any = None
        self.endpoints: Any = None

    @property
    def _stop_requests(self) -> int:
        return self.signals.stop_requests

    @property
    def _blocked(self) -> str:
        """Why copying and pruning are refused ('' when they are not)."""
        return "; ".join(v for v in dict(self._refusals).values() if v)

    def _refuse(self, source: str, problem: str | None) -> None:
        """Set or clear one refusal; logs each change once (a worker may have set it first, unlogged)."""
        if problem:
            self._refusals[source] = problem
        else:
            self._refusals.pop(source, None)
        if (problem or "") == self._refusals_logged.get(source, ""):
            return
        self._refusals_logged[source] = problem or ""
        if problem:
            self.log.error("mirror.refused", cause=problem, mirror=str(self.config.mirror), check=source)
        else:
            self.log.info("mirror.accepted", mirror=str(self.config.mirror), check=source)

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

    def _emit(self, hint: Hint) -> None:
        """Called from watcher threads."""
        self._hints.append(hint)
        self._waker.wake()

    def _on_copy_done(self, job: CopyJob, outcome: CopyResult | MirrordError) -> None:
        """Called from worker threads."""
        if isinstance(outcome, CopyResult):
            self._copied += 1
            self._verify_failed.discard(job.rel)
            with self._unmirrored_lock:
                self._unmirrored.pop(job.rel, None)
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
            if isinstance(outcome, MirrorGoneError):
                self._refusals[IDENTITY] = outcome.cause  # logged by the next heartbeat's check
        self._prune_due = True
        self._waker.wake()

    # -- main --------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.config
        # Handlers first (cli.main may have installed them even earlier): a signal during start-up
        # (lock, manifest, listener) is recorded and acted on, never fatal.
        self.signals.install()
        self.signals.wake_through(self._waker.write_fd)
        try:
            self.log.info("daemon.starting", version=__version__, pid=os.getpid(), primary=str(cfg.primary),
                          mirror=str(cfg.mirror), retention=describe_policy(cfg.prune))
            with self.mirror.lock():
                self._pin_roots()
                self.manifest = self.mirror.read_manifest()
                self.pruner = self._make_pruner(cfg)
                self.engine = Engine(cfg, self.mirror, self.manifest, self.metrics,
                                     make_room=self.pruner.make_room if self.pruner else None)
                self._start_endpoints()
                try:
                    self.pool = WorkerPool(self.engine, self.queue, cfg.copy.workers, self._on_copy_done,
                                           cfg.io.ionice, rescans=True)
                    self._start_watcher(cfg)  # before the first scan, so nothing committed in between is missed
                    if not self._stop_requests:
                        self._loop()
                finally:
                    self._shutdown()
        finally:
            self.signals.restore()
        self.log.info("daemon.stopped", copied=self._copied, failed=self._failed)
        return self._exit_code

    def _pin_roots(self) -> None:
        """Neither scan ever enters the other root, whatever path leads there (bind mounts)."""
        with contextlib.suppress(OSError):
            self.primary.exclude = frozenset({self.mirror.key()})
            self.mirror.exclude = frozenset({self.primary.key()})

    def _start_watcher(self, cfg: Config) -> None:
        try:
            self._watch_key = self.primary.key()
        except OSError:
            self._watch_key = None
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

    def _ping_interval(self, cfg: Config) -> float:
        """The heartbeat period systemd's watchdog can live with; warns when the config asks for slower."""
        heartbeat, watchdog = cfg.daemon.heartbeat_seconds, self.notifier.watchdog_seconds
        every = ping_interval(heartbeat, watchdog)
        if every < heartbeat:
            self.log.warning("daemon.heartbeat_slower_than_watchdog", heartbeat_seconds=heartbeat,
                             watchdog_seconds=watchdog, ping_every_seconds=every,
                             hint="lower daemon.heartbeat_seconds below half of the unit's WatchdogSec")
        return every

    def _loop(self) -> None:
        cfg = self.config
        self._ping_every = self._ping_interval(cfg)
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
            if self._prune_at is not None:
                deadlines.append(self._prune_at)
            self._waker.wait(min(deadlines) - time.monotonic() if not self._hints else 0)
            if self._stop_requests:
                break
            if self.signals.reload_requested:
                self.signals.reload_requested = False
                self._reload()
            now = time.monotonic()
            if self._drain_hints() or self._rescan_asked or now >= next_rescan:
                self._rescan_asked = False
                self._reconcile()
                next_rescan = time.monotonic() + cfg.watch.rescan_interval_seconds
            if (self._unsettled or self._invalid) and now >= next_settle:
                self._recheck_unsettled()
                next_settle = now + min(0.5, cfg.copy.settle_seconds or 0.5)
            if self._prune_at is not None and now >= self._prune_at:
                self._prune_at, self._prune_due = None, True
            if self._prune_due:
                self._prune_due = False
                self._prune()
            if time.monotonic() >= self._next_heartbeat:
                self._heartbeat()

    # -- reconcile and hints ------------------------------------------------------------------------
    def _reconcile(self) -> None:
        started = time.monotonic()
        psnap = self.primary.snapshot(self.config.patterns)
        for msg in psnap.errors:
            self.log.error("scan.error", cause=msg)
        for rel, why in psnap.skipped:
            self.log.warning("scan.skipped", path=rel, why=why, volume="primary")
        self._refuse(IDENTITY, self.mirror.identity_problem())
        # The manifest is read before the mirror is listed: a copy recorded in it was published before
        # it was recorded, so the listing cannot miss it (a copy published meanwhile is rechecked).
        entries = self.manifest.entries
        if self._refusals.get(IDENTITY):
            self._track_unmirrored(psnap, self._as_recorded(entries), entries, replace=True)
            self.log.debug("reconcile.refused", cause=self._blocked)
            return
        msnap = self.mirror.snapshot(self.config.patterns)
        for msg in msnap.errors:
            self.log.error("scan.error", cause=msg)
        if self._mirror_looks_unmounted(msnap, entries):
            # Nothing is queued while the mirror is refused, yet it falls behind: keep lag honest.
            self._track_unmirrored(psnap, self._as_recorded(entries), entries, replace=True)
            self.log.debug("reconcile.refused", cause=self._blocked)
            return
        self._log_rollbacks(psnap)
        # Prune first: its plan tells the copy planner which old steps retention has retired.
        self._prune(psnap, msnap)
        queued = self._enqueue(psnap, msnap, entries=entries)
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

    def _mirror_looks_unmounted(self, msnap: Snapshot, entries: Mapping[str, ManifestEntry]) -> bool:
        is_mount = self.config.mirror.is_mount() if self.config.mirror_must_be_mountpoint else None
        self._refuse(LISTING, mirror_unmounted(msnap, entries, is_mount))
        return bool(self._blocked)

    @staticmethod
    def _as_recorded(entries: Mapping[str, ManifestEntry]) -> Snapshot:
        """The mirror as the manifest describes it (for the lag while the mirror cannot be listed)."""
        return Snapshot({rel: FileState(rel, e.size, e.mirror_mtime_ns if e.mirror_mtime_ns is not None
                                        else e.source_mtime_ns) for rel, e in entries.items()})

    def _track_unmirrored(self, psnap: Snapshot, msnap: Snapshot, entries: Mapping[str, ManifestEntry],
                          replace: bool) -> None:
        """While the mirror is refused: which committed primary files lack their mirror copy."""
        plan = plan_copies(psnap, msnap, entries, self.config.step_regex)
        retired = self.pruner.retired if self.pruner is not None else (lambda run, step, mtime_ns=None: False)
        self._behind([j for j in plan.jobs if not retired(j.run, j.step, j.mtime_ns) and j.rel not in self._unsettled],
                     replace)

    def _behind(self, jobs: list[CopyJob], replace: bool) -> None:
        """Remember since when each of `jobs` lacks its mirror copy (the lag gauge reads this)."""
        now = time.time()
        with self._unmirrored_lock:
            behind = {} if replace else self._unmirrored
            for job in jobs:
                entry = self.manifest.get(job.rel)
                if entry is not None and (entry.size, entry.source_mtime_ns) == (job.size, job.mtime_ns) \
                        and job.why not in VERIFY_FAILURES:
                    continue  # copied and recorded since the plan was made
                mtime = job.mtime_ns / 1e9
                since = mtime if 0 < mtime <= now else now
                behind[job.rel] = min(since, self._unmirrored.get(job.rel, since))
            self._unmirrored = behind

    def _enqueue(self, psnap: Snapshot, msnap: Snapshot, partial: bool = False,
                 entries: Mapping[str, ManifestEntry] | None = None) -> int:
        if self._blocked:
            return 0  # every enqueue path honours a refusal (the settle recheck, hints, reconciles)
        entries = self.manifest.entries if entries is None else entries
        plan = plan_copies(psnap, msnap, entries, self.config.step_regex,
                           self.settle.at(time.monotonic()))
        # Steps retention already pruned would only be pruned again (prune.primary = false keeps them).
        retired = self.pruner.retired if self.pruner is not None else (lambda run, step, mtime_ns: False)
        queued = 0
        behind, jobs = [], []
        for job in plan.jobs:
            with self._invalid_lock:
                invalid = self._invalid.get(job.rel)
            src = psnap.files.get(job.rel)
            if invalid is not None and src is not None and src.identity == invalid.identity:
                continue  # judged invalid as it is now; retried once it changes and settles again
            if retired(job.run, job.step, job.mtime_ns):
                continue
            if job.why in VERIFY_FAILURES and not self._still_damaged(job, psnap.files[job.rel]):
                continue  # published and recorded while we listed: not damage, not a job
            behind.append(job)
            if job.rel in self._looping or self._copy_loops(job):
                continue
            jobs.append(job)
        if partial:
            self._unsettled.update(plan.unsettled)
            self._unsettled.difference_update(j.rel for j in plan.jobs)
        else:
            self._unsettled = set(plan.unsettled)
        self._behind(behind, replace=not partial)
        for job in jobs:
            if not self.queue.put(job):
                continue
            queued += 1
            if job.why in VERIFY_FAILURES and job.rel not in self._verify_failed:
                # The manifest vouches for a copy that is gone or no longer what was recorded: count it
                # once per damage (until a fresh copy is recorded), then repair it by copying again.
                self._verify_failed.add(job.rel)
                self.metrics.verify_failures.inc()
                self.log.warning("mirror.verify_failed", path=job.rel, run=job.run or ".", step=job.step,
                                 why=job.why)
        return queued

    def _still_damaged(self, job: CopyJob, src: FileState) -> bool:
        """Recheck a 'missing' or 'mismatched' mirror copy against a fresh stat and manifest record: a
        copy published between the listing and the plan is not damage (no false verify failures)."""
        try:
            fresh = self.mirror.stat(job.rel)
        except (OSError, ValueError):
            return True
        return why_copy(src, self.manifest.get(job.rel), fresh) in VERIFY_FAILURES

    def _copy_loops(self, job: CopyJob) -> bool:
        """Count re-copies of the same source version; past RECOPY_LIMIT it is a problem, not a job."""
        if job.why not in VERIFY_FAILURES:
            self._recopies.pop(job.rel, None)
            return False
        key = (job.size, job.mtime_ns)
        previous, count = self._recopies.get(job.rel, (key, 0))
        count = count + 1 if previous == key else 1
        self._recopies[job.rel] = (key, count)
        if count <= RECOPY_LIMIT:
            return False
        self._looping.add(job.rel)
        self.metrics.copy_loops.set(len(self._looping))
        self.log.error("copy.loop", path=job.rel, run=job.run or ".", step=job.step, copies=count - 1,
                       why=job.why, action="not copied again until its source changes or mirrord restarts",
                       hint="the mirror does not keep what was written (timestamps, a filter, a sync tool?)")
        return True

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
            report = self.pruner.run_cycle(psnap, msnap, keep_going=self._between_deletions)
        except MirrordError as exc:
            self.log.error("prune.failed", reason=exc.reason, path=exc.path, cause=exc.cause)
            return
        if RECENTLY_SEEN in report.skips_by_reason():
            # Observations mature min_age_seconds after they start: look again then (the observation
            # clock is monotonic, so this never hastens a deletion; a later rescan also covers it).
            due = time.monotonic() + self.config.prune.min_age_seconds
            self._prune_at = due if self._prune_at is None else min(self._prune_at, due)

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
        self._check_mirror()
        # (An unmounted mirror takes its lock file along: that is a refusal, handled above.)
        lost = None if self._refusals.get(IDENTITY) else self.mirror.lock_problem()
        if lost:
            self.log.error("mirror.lock_lost", cause=lost, action="stopping")
            self._exit_code = 1
            self.signals.stop_requests += 1
            self._waker.wake()
        problems += self._check_watcher()
        self._health = (not problems, "; ".join(problems) or "ok")
        self._last_heartbeat = time.monotonic()
        self._next_heartbeat = self._last_heartbeat + self._ping_every
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

    def _check_mirror(self) -> None:
        """Every heartbeat: is the mirror still the pinned volume, and is its manifest still ours?"""
        self._refuse(IDENTITY, self.mirror.identity_problem())
        if self._refusals.get(IDENTITY):
            return
        damage = self.manifest.disk_problem()
        if damage is None:
            if self._refusals.get(MANIFEST):
                self._refuse(MANIFEST, None)
            return
        try:
            self.manifest.repair()
        except MirrordError as exc:
            self._refuse(MANIFEST, f"{damage}; cannot repair it: {exc.cause}; fix the path, or stop mirrord "
                                   f"and run `mirrord repair-manifest`")
            return
        self.metrics.manifest_repairs.inc()
        self.log.error("manifest.repaired", cause=damage, entries=len(self.manifest))
        self._refuse(MANIFEST, None)

    def _check_watcher(self) -> list[str]:
        """Re-arm the watcher when the primary root is another directory now (recreated, or a filesystem
        mounted on it) or the watcher died; a dead watcher is reported for this heartbeat."""
        try:
            key: tuple[int, int] | None = self.primary.key()
        except OSError as exc:
            return [f"primary root {self.config.primary}: {exc.strerror or exc}"]
        problems = []
        alive = self.watcher is not None and self.watcher.is_alive()
        if not alive:
            problems.append("filesystem watcher stopped")
        if alive and key == self._watch_key:
            return problems
        why = "watcher died" if not alive else "primary root changed (recreated or mounted over)"
        self.log.warning("watch.rearm", why=why, primary=str(self.config.primary))
        if self.watcher is not None:
            with contextlib.suppress(Exception):
                self.watcher.stop()
        try:
            self._start_watcher(self.config)
        except OSError as exc:
            problems.append(f"cannot watch {self.config.primary}: {exc.strerror or exc}")
        self._hints.append(Hint("", committed=False, rescan=True))  # what changed meanwhile
        self._waker.wake()
        return problems

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self.queue.depth())
        for name, volume in (("primary", self.primary), ("mirror", self.mirror)):
            if name == "mirror" and self._refusals.get(IDENTITY):
                continue  # that would be the free space of whatever is under the mount point
            try:
                free, total = volume.space()
            except OSError:
                continue
            self.metrics.free_bytes.labels(name).set(free)
            self.metrics.total_bytes.labels(name).set(total)
        now_wall, now_mono = time.time(), time.monotonic()
        lag = 0.0
        for entry in self.queue.pending():
            lag = max(lag, now_mono - entry.first_seen)
        with self._unmirrored_lock:
            oldest = min(self._unmirrored.values(), default=now_wall)
        self.metrics.lag.set(max(lag, now_wall - oldest))

    def _status(self) -> str:
        status = (f"{self._copied} copied, {self._failed} failed, queue {self.queue.depth()}, "
                  f"unsettled {len(self._unsettled)}, invalid {len(self._invalid)}")
        if self._blocked:
            status += f"; REFUSED: {self._blocked}"
        elif self._last_error:
            status += f"; last error: {self._last_error}"
        if self._looping:
            status += f"; {len(self._looping)} file(s) re-copied in a loop, not copied again"
        return status

    # -- reload and shutdown ------------------------------------------------------------------------
    def _reload(self) -> None:
        self.notifier.reloading()
        try:
            new, stable = self.reload_config()
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
        risky = risky_changes(self.config, new)
        if risky and not stable:
            # A half-written file reads as defaults for the missing sections or a cut number: never
            # let such a read make retention delete more.
            self.log.error("config.reload_refused", keys=risky, why="the file kept changing while it was "
                           "read; write it to a temporary name and rename it into place, then reload again")
            self.notifier.status(self._status())
            return
        self.config = new
        self._ping_every = self._ping_interval(new)
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


def run_daemon(
    config: Config, reload_config: Callable[[], tuple[Config, bool]], signals: SignalFlags | None = None
) -> int:
    """Run until SIGTERM/SIGINT (0), or until the mirror lock is lost (1); raises StartupError when it
    cannot start as configured."""
    return Daemon(config, reload_config, signals=signals).run()
