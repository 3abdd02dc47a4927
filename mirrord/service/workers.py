"""The copy worker pool: threads that take jobs from the JobQueue, run the copy function, retry as
the RetryPolicy says, and are supervised (a copy without progress is abandoned and retried). Copies
that the copy function only staged (published, not yet durable in their directory nor recorded) go to
the pool's commit stage (mirrord.service.commits), which commits those that finish together at once."""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.errors import CancelledError, MirrordError, SourceChangedError, SourceGoneError
from mirrord.obs.log import get_logger
from mirrord.service.commits import CommitStage
from mirrord.service.copier import CopyControl, release_thread_buffers
from mirrord.service.engine import Engine, StagedCopy
from mirrord.service.jobqueue import JobQueue, QueuedJob
from mirrord.service.pacing import Pacer
from mirrord.service.progress import log_progress
from mirrord.service.retry import RetryPolicy

_IOPRIO_CLASSES = {"best-effort": 2, "idle": 3}
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def set_thread_ionice(klass: str) -> bool:
    """ioprio_set for the calling thread (Linux); returns False where unsupported."""
    if klass not in _IOPRIO_CLASSES or platform.machine() not in _IOPRIO_SET:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    value = (_IOPRIO_CLASSES[klass] << 13) | (7 if klass == "best-effort" else 0)
    return bool(libc.syscall(_IOPRIO_SET[platform.machine()], 1, threading.get_native_id(), value) == 0)


def set_thread_nice(nice: int) -> bool:
    """Raise the calling thread's nice value to `nice` (Linux: a thread id is a PRIO_PROCESS target); never
    lowers it. Returns False where that fails."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True


def set_thread_idle_policy() -> bool:
    """SCHED_IDLE for the calling thread (Linux): it runs only on a CPU that nothing else wants, and a
    waking trainer thread preempts it at once (nice 19 still takes a slice of a busy CPU). Threads it
    starts inherit the policy. Returns False where that fails."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def lower_priority(ionice: str, cpu_nice: int, cpu_policy: str) -> None:
    """Give the calling thread the I/O and CPU priority of copies (`[io]`); a setting the system refuses
    is logged, and the thread goes on at its priority."""
    log = get_logger()
    if ionice != "none" and not set_thread_ionice(ionice):
        log.warning("worker.ionice_unsupported", ionice=ionice)
    if cpu_nice and not set_thread_nice(cpu_nice):
        log.warning("worker.cpu_nice_unsupported", cpu_nice=cpu_nice)
    if cpu_policy == "idle" and not set_thread_idle_policy():
        log.warning("worker.cpu_policy_unsupported", cpu_policy=cpu_policy)


DEFAULT_RETRY = RetryPolicy()


@dataclass
class _Worker:
    name: str
    thread: threading.Thread | None = None
    entry: QueuedJob | None = None
    control: CopyControl | None = None
    retiring: bool = False
    abandoned: bool = False


class WorkerPool:
    """`size` threads running `copy_fn` on queued jobs; the supervisor calls check_stalls() every heartbeat.

    `copy_fn` returns a CopyResult (the copy is done), or a StagedCopy that `commit` (required then)
    makes durable and records, in batches, on the pool's commit thread. `on_done(job, outcome)` is
    called once per job, from a worker or the commit thread, when it is finished (committed, failed
    for good, or cancelled); `on_stalled(job)` when a copy is abandoned for lack of progress.
    """

    def __init__(
        self,
        copy_fn: Callable[[CopyJob, CopyControl], CopyResult | StagedCopy],
        queue: JobQueue,
        size: int,
        *,
        commit: Callable[[Sequence[StagedCopy]], list[CopyResult | MirrordError]] | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        on_done: Callable[[CopyJob, CopyResult | MirrordError], None] = lambda job, outcome: None,
        on_stalled: Callable[[CopyJob], None] = lambda job: None,
        clock: Callable[[], float] = time.monotonic,
        ionice: str = "none",
        cpu_nice: int = 0,
        cpu_policy: str = "normal",
        pacer: Pacer | None = None,
    ) -> None:
        self.copy_fn = copy_fn
        self.pacer = pacer
        self.queue = queue
        self.retry = retry  # swapped whole by a reload
        self.on_done = on_done
        self.on_stalled = on_stalled
        self.clock = clock
        self.ionice = ionice
        self.cpu_nice = cpu_nice
        self.cpu_policy = cpu_policy
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._names = itertools.count(1)
        self._stopping = threading.Event()
        self._cancel_why = ""
        self.log = get_logger()
        self.commits = None if commit is None else CommitStage(commit, self._finish_safely, self._busy)
        self.resize(size)

    # -- lifecycle -----------------------------------------------------------------------------------
    def resize(self, size: int) -> None:
        """Run `size` workers: new ones start now; surplus ones retire after their current copy."""
        with self._lock:
            self.size = size
            self._staff_locked()

    def _staff_locked(self) -> int:
        """Start workers up to the pool's size, within twice the size in threads with the abandoned copies still
        stuck: on a hung mount each replacement would wedge too, with its buffers. Returns how many are missing."""
        active = [w for w in self._workers if not (w.retiring or w.abandoned)]
        for worker in active[self.size :]:
            worker.retiring = True
        missing = max(0, self.size - len(active))
        start = max(0, min(missing, missing + self.size - sum(w.abandoned for w in self._workers)))
        for _ in range(start):
            self._spawn_locked()
        return missing - start

    def _spawn_locked(self) -> None:
        worker = _Worker(f"mirrord-copy-{next(self._names)}")
        # Daemon threads: a copy wedged in the kernel (hung mount) must not keep the process alive.
        worker.thread = threading.Thread(target=self._run, args=(worker,), name=worker.name, daemon=True)
        self._workers.append(worker)
        worker.thread.start()

    def stop(self, grace: float, force: Callable[[], bool] = lambda: False, why: str = "") -> bool:
        """Stop taking work; let copies finish for `grace` seconds (or until `force()`), then cancel
        them (their temp files are removed; each logs copy.aborted, with `why`, unless a second signal cut the
        grace short). True if every worker ended."""
        self._stopping.set()
        self.queue.drop_waiting()
        self.queue.close()
        deadline = self.clock() + grace
        for thread in self.threads():
            while thread.is_alive() and self.clock() < deadline and not force():
                thread.join(timeout=0.2)
        late = [t for t in self.threads() if t.is_alive()]
        self._cancel_why = "second stop signal" if force() else why or f"shutdown grace period ({grace:g} s) over"
        running = self.active_controls()
        if running:  # before the copies end (a copy blocked in a read ends only when the read returns)
            self.log.info("stop.cancelling_copies", copies=len(running), why=self._cancel_why)
        for control in running:
            control.stop("cancelled")
        for thread in late:
            thread.join(timeout=5)
        # Copies staged before the end are published: commit them (a few fsyncs), rather than leave
        # them for the next start to copy again.
        committed = self.commits is None or self.commits.stop(timeout=max(5.0, deadline - self.clock()))
        return committed and not any(t.is_alive() for t in late)

    def threads(self) -> list[threading.Thread]:
        """Every worker thread, running or retiring (not the commit thread)."""
        with self._lock:
            return [w.thread for w in self._workers if w.thread is not None]

    # -- supervision ------------------------------------------------------------------------------
    def check_stalls(self, stall_seconds: float) -> list[str]:
        """Abandon copies without progress for stall_seconds (their job is retried by a fresh worker, while the
        pool holds no more than twice its size in threads).

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
                self.log.warning(
                    "copy.stalled",
                    path=job.rel,
                    run=job.run or ".",
                    step=job.step,
                    seconds_without_progress=round(idle, 1),
                    worker=worker.name,
                )
                self.on_stalled(job)
                control.stop("stalled")
                with self._lock:
                    worker.abandoned = True
                    missing = self._staff_locked()
                if missing:
                    self.log.error("worker.not_replaced", worker=worker.name, path=job.rel, missing=missing)
                # The path is handed to a fresh attempt now; the stuck thread, if it ever returns,
                # discards its own temp file only (see atomic.discard_temp) and touches nothing else.
                self.queue.release_for_retry(entry, 0.0)
            elif worker.abandoned and idle >= 3 * stall_seconds:
                problems.append(f"worker {worker.name} wedged in {entry.job.rel} for {idle:.0f} s")
        with self._lock:
            alive = [w for w in self._workers if w.thread is not None and w.thread.is_alive()]
            dead = [w for w in self._workers if w not in alive and not (w.retiring or w.abandoned)]
            self._workers = alive
            missing = 0 if self._stopping.is_set() else self._staff_locked()  # (a stuck copy returned: replaced)
        if not self._stopping.is_set():
            problems.extend(f"worker {w.name} died" for w in dead)
        if missing:
            problems.append(f"{missing} copy worker(s) not replaced while abandoned copies are stuck (a hung mount?)")
        if self.commits is not None:
            wedged = self.commits.problem(stall_seconds)
            if wedged is not None:
                problems.append(wedged)
            elif not self.commits.thread.is_alive() and not self._stopping.is_set():
                problems.append("the commit thread died")
        return problems

    def _busy(self) -> bool:
        """Whether more copies are coming soon: a job being copied, or one ready to be."""
        with self._lock:
            copying = any(w.entry is not None for w in self._workers if not w.abandoned)
        return copying or self.queue.has_ready()

    def active_controls(self) -> list[CopyControl]:
        """The controls of the copies running now (to cancel them)."""
        with self._lock:
            return [w.control for w in self._workers if w.control is not None]

    # -- the worker loop ---------------------------------------------------------------------------
    def _run(self, worker: _Worker) -> None:
        lower_priority(self.ionice, self.cpu_nice, self.cpu_policy)
        while not (self._stopping.is_set() or worker.retiring or worker.abandoned):
            entry = self.queue.get(timeout=1.0)
            if entry is None:
                release_thread_buffers()  # idle for a second: its copy buffers go back to the system
                continue
            control = CopyControl(clock=self.clock, pacer=self.pacer)
            with self._lock:
                worker.entry, worker.control = entry, control
            try:
                outcome: CopyResult | StagedCopy | MirrordError = self.copy_fn(entry.job, control)
                if isinstance(outcome, StagedCopy) and self.commits is None:
                    raise TypeError("a staged copy, but the pool has no commit stage")
            except MirrordError as exc:
                outcome = exc
            except Exception as exc:  # a bug must not kill the pool silently: log it, count it, go on
                self.log.exception("worker.crashed_job", path=entry.job.rel)
                outcome = MirrordError(entry.job.rel, f"internal error: {exc!r}")
            with self._lock:
                worker.entry = worker.control = None
                abandoned = worker.abandoned
            if abandoned:
                if isinstance(outcome, StagedCopy):  # its retry publishes it again: never recorded from here
                    outcome.dirs.close()
                self.log.info("copy.abandoned_returned", path=entry.job.rel, outcome=type(outcome).__name__)
                return
            if isinstance(outcome, StagedCopy):
                assert self.commits is not None
                self.commits.submit(entry, outcome, control)  # the path stays reserved until committed
            else:
                self._finish_safely(entry, outcome, control)
            if self.commits is not None:
                self.commits.wake()  # this worker may now be idle: a waiting batch need not wait for it

    def _finish_safely(self, entry: QueuedJob, outcome: CopyResult | MirrordError, control: CopyControl) -> None:
        try:
            self._finish(entry, outcome, control)
        except Exception as exc:  # never leave a path reserved, nor a waiter without its outcome
            self.log.exception("worker.finish_failed", path=entry.job.rel, error=repr(exc))
            self.queue.done(entry.job.rel)
            self.on_done(entry.job, outcome)

    def _finish(self, entry: QueuedJob, outcome: CopyResult | MirrordError, control: CopyControl) -> None:
        job = entry.job
        if isinstance(outcome, CancelledError):
            # Shutdown cut this copy short (grace period over, or a second signal): its NAME.part is gone,
            # and the next start copies the file again. Say which file, and how far it had got.
            self.log.warning(
                "copy.aborted",
                path=job.rel,
                run=job.run or ".",
                step=job.step,
                size=job.size,
                bytes_done=control.bytes_done,
                why=self._cancel_why or outcome.cause,
            )
        if isinstance(outcome, SourceGoneError):
            # The trainer rotated it away before it was mirrored: nothing left to copy, nothing failed.
            self.log.info("copy.source_gone", path=job.rel, run=job.run or ".", step=job.step, cause=outcome.cause)
        if isinstance(outcome, CopyResult | CancelledError | SourceGoneError):
            self.queue.done(job.rel)
            self.on_done(job, outcome)
            return
        policy = self.retry
        stopping = self._stopping.is_set()
        # A folder unit found changed is judged again from a fresh listing (the daemon asks), never retried
        # with the file list it was planned with.
        replan = bool(job.members) and isinstance(outcome, SourceChangedError)
        retry = outcome.transient and policy.retries(entry.attempt) and not stopping and not replan
        delay = policy.delay(entry.attempt)
        # Say what will really happen: a retry after a backoff, the next rescan (which plans every file
        # the mirror still lacks, whatever the error was), or nothing.
        if retry:
            when: dict[str, Any] = {"will_retry": True, "retry": "backoff", "retry_in_seconds": round(delay, 2)}
        elif replan:
            when = {"will_retry": True, "retry": "judged_again"}
        elif policy.rescan_seconds is not None and not stopping:
            when = {"will_retry": True, "retry": "next_rescan", "retry_in_seconds": policy.rescan_seconds}
        else:
            when = {"will_retry": False, "retry": "never"}
        self.log.warning(
            "copy.failed",
            path=job.rel,
            run=job.run or ".",
            step=job.step,
            reason=outcome.reason,
            cause=outcome.cause,
            error_path=outcome.path,
            attempt=entry.attempt,
            **when,
        )
        if retry:
            self.queue.release_for_retry(entry, delay)
            return
        if outcome.transient and not replan:
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
    seen = engine.manifest.last_seq
    wanted = {job.rel for job in jobs if queue.put(replace(job, seen=seen))}
    if not wanted:
        return {}
    queue.keep_lane_for_small(engine.config.copy.small_file_bytes, min(workers, len(wanted)))
    outcomes: dict[str, CopyResult | MirrordError] = {}
    lock = threading.Lock()
    all_done = threading.Event()

    def on_done(job: CopyJob, outcome: CopyResult | MirrordError) -> None:
        with lock:
            outcomes[job.rel] = outcome
            if wanted <= outcomes.keys():
                all_done.set()

    io = engine.config.io
    pool = WorkerPool(
        engine.stage,
        queue,
        min(workers, len(wanted)),
        commit=engine.commit,
        retry=RetryPolicy.from_config(engine.config),
        on_done=on_done,
        on_stalled=lambda job: engine.count("stalled"),
        ionice=io.ionice,
        cpu_nice=io.cpu_nice,
        cpu_policy=io.cpu_policy,
        pacer=Pacer(lambda: True, engine.metrics, io.cpu_policy != "idle") if io.pacing else None,  # (the user waits)
    )
    try:
        while not all_done.wait(poll_seconds):
            lost = still_ours() if still_ours is not None else None
            if lost:
                engine.log.error("mirror.lock_lost", cause=lost, action="stopping")
                break
            pool.check_stalls(engine.config.copy.stall_seconds)
            log_progress(engine.board, engine.log)
            if not any(t.is_alive() for t in pool.threads()):
                break  # every worker died: report what is missing instead of waiting forever
    finally:
        pool.stop(grace=0, why="interrupted")  # copies still running here: Ctrl-C, or every worker died
    return outcomes
