"""Copies under way and how far along each one is: bytes done, rate, time left.

The engine tracks every copy while it runs; readers take snapshots and never slow a copy down: the
daemon's /status endpoint (and through it `mirrord status`), the `mirrord_copy_bytes_in_flight`
gauge (computed at scrape time), and `mirrord sync`'s display on a terminal. A copy that runs longer
than PROGRESS_LOG_SECONDS also logs `copy.progress` that often, so a long copy is not silent between
`copy.started` and `copy.committed`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from structlog.typing import FilteringBoundLogger

from mirrord.core.jobs import CopyJob
from mirrord.service.copier import CopyControl

PROGRESS_LOG_SECONDS = 10.0


@dataclass(frozen=True)
class CopyProgress:
    """One copy under way, as seen at one moment. The rate is the average since the copy started."""

    path: str
    run: str
    step: int | None
    size: int
    bytes_done: int
    elapsed_seconds: float

    @property
    def rate(self) -> float:
        """Bytes per second so far (0 until the first chunk)."""
        return self.bytes_done / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the rate so far; None while nothing has been copied."""
        rate = self.rate
        return max(0.0, (self.size - self.bytes_done) / rate) if rate > 0 else None

    @property
    def fraction(self) -> float:
        """Share of the bytes done, 0..1."""
        return min(1.0, self.bytes_done / self.size) if self.size else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The copy as JSON for /status."""
        eta = self.eta_seconds
        return asdict(self) | {
            "elapsed_seconds": round(self.elapsed_seconds, 3),
            "rate_bytes_per_second": round(self.rate, 1),
            "eta_seconds": None if eta is None else round(eta, 1),
        }


@dataclass
class _Tracked:
    job: CopyJob
    control: CopyControl
    started: float
    logged: float


class ProgressBoard:
    """The copies under way in this process. Thread-safe; copies register for their own duration."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._copies: dict[int, _Tracked] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def track(self, job: CopyJob, control: CopyControl) -> Iterator[None]:
        """Show `job` on the board while the block runs."""
        now = self._clock()
        key = next(self._ids)
        with self._lock:
            self._copies[key] = _Tracked(job, control, now, now)
        try:
            yield
        finally:
            with self._lock:
                del self._copies[key]

    def snapshot(self) -> list[CopyProgress]:
        """Every copy under way, by path."""
        now = self._clock()
        with self._lock:
            tracked = list(self._copies.values())
        return sorted((_progress(t, now) for t in tracked), key=lambda p: p.path)

    def bytes_in_flight(self) -> int:
        """Bytes already copied by the copies under way (0 when idle)."""
        with self._lock:
            return sum(t.control.bytes_done for t in self._copies.values())

    def due_for_log(self, every: float = PROGRESS_LOG_SECONDS) -> list[CopyProgress]:
        """Copies not reported for `every` seconds (the first report after `every` seconds of copying)."""
        now = self._clock()
        due = []
        with self._lock:
            for t in self._copies.values():
                if now - t.logged >= every:
                    t.logged = now
                    due.append(_progress(t, now))
        return due


def _progress(t: _Tracked, now: float) -> CopyProgress:
    job = t.job
    return CopyProgress(job.rel, job.run or ".", job.step, job.size, t.control.bytes_done, now - t.started)


def log_progress(board: ProgressBoard, log: FilteringBoundLogger) -> None:
    """Log `copy.progress` for each copy that has run PROGRESS_LOG_SECONDS since its last report."""
    for p in board.due_for_log():
        eta = p.eta_seconds
        log.info(
            "copy.progress",
            path=p.path,
            run=p.run,
            step=p.step,
            size=p.size,
            bytes_done=p.bytes_done,
            percent=round(100 * p.fraction, 1),
            rate_mib_s=round(p.rate / 2**20, 1),
            eta_seconds=None if eta is None else round(eta),
            seconds=round(p.elapsed_seconds, 1),
        )
