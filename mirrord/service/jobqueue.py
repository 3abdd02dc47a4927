"""The copy queue: never holds a path twice, hands out the newest step first, keeps retries
scheduled in the queue (a failing file never blocks a worker while it waits), and keeps one worker
for small files: big copies may hold at most `big_slots` workers at once, so a small step never waits
behind them."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mirrord.core.jobs import CopyJob
from mirrord.core.plan import newest_first


@dataclass(order=True)
class QueuedJob:
    """A job as the queue holds it: ordered by urgency (newest step first), with its retry state."""

    key: tuple[bool, int, int]
    seq: int
    job: CopyJob = field(compare=False)
    attempt: int = field(compare=False, default=1)
    not_before: float = field(compare=False, default=0.0)
    first_seen: float = field(compare=False, default=0.0)  # clock time it was first queued (the lag)


class JobQueue:
    """Ready jobs ordered newest step first; delayed (retry) jobs released when due. One entry per path."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ready: list[QueuedJob] = []
        self._delayed: list[tuple[float, int, QueuedJob]] = []
        self._paths: dict[str, QueuedJob] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._small_bytes = 0  # 0: no lane for small files
        self._big_slots = 1
        self._big_active: set[str] = set()

    def keep_lane_for_small(self, small_bytes: int, workers: int) -> None:
        """With `workers` workers, let copies of `small_bytes` or more hold all but one of them (all of
        a single worker: there is no second one to keep)."""
        with self._cond:
            self._small_bytes, self._big_slots = small_bytes, max(1, workers - 1)
            self._cond.notify_all()

    def _is_big(self, job: CopyJob) -> bool:
        return bool(self._small_bytes) and job.size >= self._small_bytes

    def _take_ready(self) -> QueuedJob | None:
        """The most urgent ready job a worker may take now: a big one only while a big slot is free."""
        if len(self._big_active) < self._big_slots or not self._small_bytes:
            entry = heapq.heappop(self._ready) if self._ready else None
        else:
            small = [e for e in self._ready if not self._is_big(e.job)]
            entry = min(small) if small else None
            if entry is not None:
                self._ready.remove(entry)
                heapq.heapify(self._ready)
        if entry is not None and self._is_big(entry.job):
            self._big_active.add(entry.job.rel)
        return entry

    def put(self, job: CopyJob, attempt: int = 1, delay: float = 0.0, first_seen: float | None = None) -> bool:
        """Queue a job unless its path is already queued; returns whether it was added."""
        with self._cond:
            if self._closed or job.rel in self._paths:
                return False
            now = self._clock()
            entry = QueuedJob(
                newest_first(job), next(self._seq), job, attempt, now + delay, now if first_seen is None else first_seen
            )
            self._paths[job.rel] = entry
            if delay > 0:
                heapq.heappush(self._delayed, (entry.not_before, entry.seq, entry))
            else:
                heapq.heappush(self._ready, entry)
            self._cond.notify()
            return True

    def get(self, timeout: float | None = None) -> QueuedJob | None:
        """The most urgent ready job, or None on timeout/close. The path stays reserved until done()."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = self._clock()
                while self._delayed and self._delayed[0][0] <= now:
                    heapq.heappush(self._ready, heapq.heappop(self._delayed)[2])
                entry = self._take_ready()
                if entry is not None:
                    return entry
                waits = [t - now for t in (deadline,) if t is not None]
                if self._delayed:
                    waits.append(self._delayed[0][0] - now)
                if deadline is not None and now >= deadline:
                    return None
                self._cond.wait(timeout=max(0.0, min(waits)) if waits else None)

    def done(self, rel: str) -> None:
        """The job for `rel` is finished: its path may be queued again."""
        with self._cond:
            self._paths.pop(rel, None)
            if rel in self._big_active:
                self._big_active.discard(rel)
                self._cond.notify_all()  # a big slot is free again

    def release_for_retry(self, entry: QueuedJob, delay: float) -> None:
        """Queue `entry` again as its next attempt, due in `delay` seconds."""
        with self._cond:
            self._paths.pop(entry.job.rel, None)
            self._big_active.discard(entry.job.rel)
        self.put(entry.job, entry.attempt + 1, delay, entry.first_seen)

    def paths(self) -> frozenset[str]:
        """Every path queued, waiting for a retry, or being copied."""
        with self._cond:
            return frozenset(self._paths)

    def pending(self) -> list[QueuedJob]:
        """Every job queued, waiting for a retry, or being copied."""
        with self._cond:
            return list(self._paths.values())

    def has_ready(self) -> bool:
        """Whether a job is ready to be handed out now (a retry still waiting for its time is not)."""
        with self._cond:
            return bool(self._ready) or bool(self._delayed and self._delayed[0][0] <= self._clock())

    def depth(self) -> int:
        """Jobs waiting (ready or for a retry), not those being copied."""
        with self._cond:
            return len(self._ready) + len(self._delayed)

    def close(self) -> None:
        """Wake every get() with None, now and from now on."""
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
