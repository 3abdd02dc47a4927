"""The copy worker pool: a queue that never holds a path twice, newest step first, retries with backoff
scheduled in the queue (a failing file never blocks a worker while it waits), and stall detection."""

from __future__ import annotations

import ctypes
import heapq
import itertools
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mirrord.copier import CopyControl
from mirrord.engine import Engine, backoff_delay
from mirrord.errors import CancelledError, MirrordError
from mirrord.log import get_logger
from mirrord.model import CopyJob, CopyResult
from mirrord.plan import newest_first


@dataclass(order=True)
class _Entry:
    key: tuple[bool, int, int]
    seq: int
    job: CopyJob = field(compare=False)
    attempt: int = field(compare=False, default=1)
    not_before: float = field(compare=False, default=0.0)
    first_seen: float = field(compare=False, default=0.0)


class JobQueue:
    """Ready jobs ordered newest step first; delayed (retry) jobs released when due. One entry per path."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ready: list[_Entry] = []
        self._delayed: list[tuple[float, int, _Entry]] = []
        self._paths: dict[str, _Entry] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, job: CopyJob, attempt: int = 1, delay: float = 0.0, first_seen: float | None = None) -> bool:
        """Queue a job unless its path is already queued; returns whether it was added."""
        with self._cond:
            if self._closed or job.rel in self._paths:
                return False
            now = self._clock()
            entry = _Entry(newest_first(job), next(self._seq), job, attempt, now + delay,
                           now if first_seen is None else first_seen)
            self._paths[job.rel] = entry
            if delay > 0:
                heapq.heappush(self._delayed, (entry.not_before, entry.seq, entry))
            else:
                heapq.heappush(self._ready, entry)
            self._cond.notify()
            return True

    def get(self, timeout: float | None = None) -> _Entry | None:
        """The most urgent ready job, or None on timeout/close. The path stays reserved until done()."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = self._clock()
                while self._delayed and self._delayed[0][0] <= now:
                    heapq.heappush(self._ready, heapq.heappop(self._delayed)[2])
                if self._ready:
                    return heapq.heappop(self._ready)
                waits = [t - now for t in (deadline,) if t is not None]
                if self._delayed:
                    waits.append(self._delayed[0][0] - now)
                if deadline is not None and now >= deadline:
                    return None
                self._cond.wait(timeout=max(0.0, min(waits)) if waits else None)

    def done(self, rel: str) -> None:
        with self._cond:
            self._paths.pop(rel, None)

    def release_for_retry(self, entry: _Entry, delay: float) -> None:
        with self._cond:
            self._paths.pop(entry.job.rel, None)
        self.put(entry.job, entry.attempt + 1, delay, entry.first_seen)

    def paths(self) -> frozenset[str]:
        """Every path queued, waiting for a retry, or being copied."""
        with self._cond:
            return frozenset(self._paths)

    def pending(self) -> list[_Entry]:
        with self._cond:
            return list(self._paths.values())

    def depth(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._delayed)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drop_waiting(self) -> None:
        """Forget jobs not yet started (shutdown): they are found again by the next start's reconcile."""
        with self._cond:
            for entry in self._ready + [d[2] for d in self._delayed]:
                self._paths.pop(entry.job.rel, None)
            self._ready.clear()
            self._delayed.clear()


_IOPRIO_CLASSES = {"best-effort": 2, "idle": 3}
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def set_thread_ionice(klass: str) -> bool:
    """ioprio_set for the calling thread (Linux); returns False where unsupported."""
    if klass not in _IOPRIO_CLASSES or platform.machine() not in _IOPRIO_SET:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    value = (_IOPRIO_CLASSES[klass] << 13) | (7 if klass == "best-effort" else 0)
    return bool(libc.syscall(_IOPRIO_SET[platform.machine()], 1, threading.get_native_id(), value) == 0)


@dataclass
class _Worker:
    name: str
    thread: threading.Thread | None = None
    entry: _Entry | None = None
    job: CopyJob | None = None
    control: CopyControl | None = None
    retiring: bool = False
    abandoned: bool = False


class WorkerPool:
    """`size` threads running Engine.copy_once; the supervisor calls check_stalls() every heartbeat."""

    def __init__(
        self,
        engine: Engine,
        queue: JobQueue,
        size: int,
        on_done: Callable[[CopyJob, CopyResult | MirrordError], None] = lambda job, outcome: None,
        ionice: str = "none",
        clock: Callable[[], float] = time.monotonic,
        rescans: bool = False,
    ) -> None:
        """`rescans`: a periodic reconcile will plan a file that failed for good again (the daemon),
        so `copy.failed` can say when it will be tried next."""
        self.engine = engine
        self.rescans = rescans
        self.queue = queue
        self.on_done = on_done
        self.ionice = ionice
        self.clock = clock
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._names = itertools.count(1)
        self._stopping = threading.Event()
        self._cancel_why = ""
        self.log = get_logger()
        self.resize(size)

    # -- lifecycle -----------------------------------------------------------------------------------
    def resize(self, size: int) -> None:
        with self._lock:
            active = [w for w in self._workers if not (w.retiring or w.abandoned)]
            for worker in active[size:]:
                worker.retiring = True
            for _ in range(size - len(active)):
                self._spawn_locked()

    def _spawn_locked(self) -> None:
        worker = _Worker(f"mirrord-copy-{next(self._names)}")
        # Daemon threads: a copy wedged in the kernel (hung mount) must not keep the process alive.
        worker.thread = threading.Thread(target=self._run, args=(worker,), name=worker.name, daemon=True)
        self._workers.append(worker)
        worker.thread.start()

    def stop(self, grace: float, force: Callable[[], bool] = lambda: False, why: str = "") -> bool:
        """Stop taking work; let copies finish for `grace` seconds (or until `force()`), then cancel
        them (their temp files are removed; each logs copy.aborted, with `why` if given). True if every
        worker ended."""
        self._stopping.set()
        self.queue.drop_waiting()
        self.queue.close()
        deadline = self.clock() + grace
        for thread in self.threads():
            while thread.is_alive() and self.clock() < deadline and not force():
                thread.join(timeout=0.2)
        late = [t for t in self.threads() if t.is_alive()]
        self._cancel_why = why or ("second stop signal" if force() else f"shutdown grace period ({grace:g} s) over")
        for control in self.active_controls():
            control.stop("cancelled")
        for thread in late:
            thread.join(timeout=5)
        return not any(t.is_alive() for t in late)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [w.thread for w in self._workers if w.thread is not None]

    # -- supervision ------------------------------------------------------------------------------
    def check_stalls(self, stall_seconds: float) -> list[str]:
        """Abandon copies without progress for stall_seconds (their job is retried by a fresh worker).

        Returns problems for the health check: a worker still stuck in a copy 2x stall_seconds after
        being abandoned is wedged in the kernel (a hung mount); only a restart frees it.
        """
        problems: list[str] = []
        now = self.clock()
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            control, entry = worker.control, worker.entry
            if control is None or entry is None:
                continue
            idle = now - control.last_progress
            if idle >= stall_seconds and not worker.abandoned:
                job = entry.job
                self.log.warning("copy.stalled", path=job.rel, run=job.run or ".", step=job.step,
                                 seconds_without_progress=round(idle, 1), worker=worker.name)
                self.engine.metrics.copy_result("stalled")
                control.stop("stalled")
                with self._lock:
                    worker.abandoned = True
                    self._spawn_locked()
                # The path is handed to a fresh attempt now; the stuck thread, if it ever returns,
                # discards its own temp file only (see atomic.discard_temp) and touches nothing else.
                self.queue.release_for_retry(entry, 0.0)
            elif worker.abandoned and idle >= 3 * stall_seconds:
                problems.append(f"worker {worker.name} wedged in {entry.job.rel} for {idle:.0f} s")
        with self._lock:
            alive = [w for w in self._workers if w.thread is not None and w.thread.is_alive()]
            dead = [w for w in self._workers if w not in alive and not (w.retiring or w.abandoned)]
            self._workers = alive
        if not self._stopping.is_set():
            problems.extend(f"worker {w.name} died" for w in dead)
        return problems

    def report_progress(self) -> None:
        """Log `copy.progress` for each copy that has run PROGRESS_LOG_SECONDS since its last report."""
        for p in self.engine.board.due_for_log():
            eta = p.eta_seconds
            self.log.info("copy.progress", path=p.path, run=p.run, step=p.step, size=p.size,
                          bytes_done=p.bytes_done, percent=round(100 * p.fraction, 1),
                          rate_mib_s=round(p.rate / 2**20, 1), eta_seconds=None if eta is None else round(eta),
                          seconds=round(p.elapsed_seconds, 1))

    def active_controls(self) -> list[CopyControl]:
        with self._lock:
            return [w.control for w in self._workers if w.control is not None]

    # -- the worker loop ---------------------------------------------------------------------------
    def _run(self, worker: _Worker) -> None:
        if self.ionice != "none" and not set_thread_ionice(self.ionice):
            self.log.warning("worker.ionice_unsupported", ionice=self.ionice)
        while not (self._stopping.is_set() or worker.retiring or worker.abandoned):
            entry = self.queue.get(timeout=1.0)
            if entry is None:
                continue
            control = CopyControl(clock=self.clock)
            with self._lock:
                worker.entry, worker.job, worker.control = entry, entry.job, control
            try:
                outcome: CopyResult | MirrordError = self.engine.copy_once(entry.job, control)
            except MirrordError as exc:
                outcome = exc
            except Exception as exc:  # a bug must not kill the pool silently: log it, count it, go on
                self.log.exception("worker.crashed_job", path=entry.job.rel)
                outcome = MirrordError(entry.job.rel, f"internal error: {exc!r}")
            with self._lock:
                worker.entry = worker.job = worker.control = None
                abandoned = worker.abandoned
            if abandoned:
                self.log.info("copy.abandoned_returned", path=entry.job.rel, outcome=type(outcome).__name__)
                return
            try:
                self._finish(entry, outcome, control)
            except Exception:  # never leave a path reserved, nor a waiter without its outcome
                self.queue.done(entry.job.rel)
                self.on_done(entry.job, outcome)

    def _finish(self, entry: _Entry, outcome: CopyResult | MirrordError, control: CopyControl) -> None:
        job = entry.job
        if isinstance(outcome, CancelledError):
            # Shutdown cut this copy short (grace period over, or a second signal): its NAME.part is gone,
            # and the next start copies the file again. Say which file, and how far it had got.
            self.log.warning("copy.aborted", path=job.rel, run=job.run or ".", step=job.step, size=job.size,
                             bytes_done=control.bytes_done, why=self._cancel_why or outcome.cause)
        if isinstance(outcome, CopyResult | CancelledError):
            self.queue.done(job.rel)
            self.on_done(job, outcome)
            return
        cfg = self.engine.config.copy
        stopping = self._stopping.is_set()
        retry = outcome.transient and entry.attempt < cfg.max_attempts and not stopping
        delay = backoff_delay(entry.attempt, cfg.retry_backoff_seconds, cfg.retry_backoff_max_seconds)
        # Say what will really happen: a retry after a backoff, the next rescan (which plans every file
        # the mirror still lacks, whatever the error was), or nothing.
        if retry:
            when: dict[str, Any] = {"will_retry": True, "retry": "backoff", "retry_in_seconds": round(delay, 2)}
        elif self.rescans and not stopping:
            when = {"will_retry": True, "retry": "next_rescan",
                    "retry_in_seconds": self.engine.config.watch.rescan_interval_seconds}
        else:
            when = {"will_retry": False, "retry": "never"}
        self.log.warning(
            "copy.failed", path=job.rel, run=job.run or ".", step=job.step, reason=outcome.reason,
            cause=outcome.cause, error_path=outcome.path, attempt=entry.attempt, **when,
        )
        if retry:
            self.queue.release_for_retry(entry, delay)
            return
        if outcome.transient:
            self.log.error("copy.gave_up", path=job.rel, reason=outcome.reason, attempts=entry.attempt)
        self.queue.done(job.rel)
        self.on_done(job, outcome)


def copy_all(
    engine: Engine,
    jobs: list[CopyJob],
    workers: int,
    poll_seconds: float = 0.25,
    still_ours: Callable[[], str | None] | None = None,
) -> dict[str, CopyResult | MirrordError]:
    """Copy `jobs` on a temporary pool (the daemon's retries, backoff and stall detection) and wait for
    every outcome; the one-shot commands use this so that they behave exactly like the daemon.

    `still_ours()` (the mirror lock check) is asked at every poll: once it names a problem, copies in
    flight are cancelled and nothing more is started (their outcomes are missing)."""
    queue = JobQueue()
    wanted = {job.rel for job in jobs if queue.put(job)}
    if not wanted:
        return {}
    outcomes: dict[str, CopyResult | MirrordError] = {}
    lock = threading.Lock()
    all_done = threading.Event()

    def on_done(job: CopyJob, outcome: CopyResult | MirrordError) -> None:
        with lock:
            outcomes[job.rel] = outcome
            if wanted <= outcomes.keys():
                all_done.set()

    pool = WorkerPool(engine, queue, min(workers, len(wanted)), on_done, engine.config.io.ionice)
    try:
        while not all_done.wait(poll_seconds):
            lost = still_ours() if still_ours is not None else None
            if lost:
                engine.log.error("mirror.lock_lost", cause=lost, action="stopping")
                break
            pool.check_stalls(engine.config.copy.stall_seconds)
            pool.report_progress()
            if not any(t.is_alive() for t in pool.threads()):
                break  # every worker died: report what is missing instead of waiting forever
    finally:
        pool.stop(grace=0, why="interrupted")  # copies still running here: Ctrl-C, or every worker died
    return outcomes

