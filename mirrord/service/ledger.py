"""The daemon's account of its copies, shared by worker threads (outcomes) and the main loop (plans):
what was copied or failed, which sources are invalid as they are now, what lags since when, which
mirror copies were found damaged, and which files are re-copied in a loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass

from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.core.model import ManifestEntry
from mirrord.errors import InvalidSourceError, MirrordError, SourceGoneError
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.service.jobqueue import QueuedJob
from mirrord.service.refusals import IDENTITY, Refusals
from mirrord.store.identity import MirrorGoneError

# Copy reasons that mean a mirrored file no longer matches its manifest record (checked by stat on every
# reconcile; `mirrord verify` checks content hashes, in its own process, and reports by exit status).
VERIFY_FAILURES = ("mirror_missing", "mirror_mismatch")
# A file re-copied this many times for the same source (size, mtime) with the same outcome is a
# problem to report (status, metrics), not a job: copying it again would loop forever.
RECOPY_LIMIT = 3


@dataclass
class Invalid:
    """A source that failed its validator: not retried until it changes; reported after the grace."""

    identity: Hashable | None  # of the file, or of every file of a folder unit
    since: float  # monotonic: first failure (kept while the file keeps failing)
    status: str
    cause: str
    reported: bool = False
    files: frozenset[str] = frozenset()  # the primary files it concerns (a folder unit's, every one)


class Ledger:
    """Counts and per-file records; every method is safe to call from any thread."""

    def __init__(
        self, metrics: Metrics, refusals: Refusals, monotonic: Callable[[], float], wall: Callable[[], float]
    ) -> None:
        self.metrics, self.refusals = metrics, refusals
        self.monotonic, self.wall = monotonic, wall
        self.copied = self.failed = 0
        self.last_error = ""
        self.verify_failed: set[str] = set()  # the loop adds, workers discard (single set ops)
        self.looping: dict[str, tuple[int, int]] = {}  # rel -> the source (size, mtime) copied in a loop
        metrics.copy_loops.set_function(lambda: len(self.looping))
        self._recopies: dict[str, tuple[tuple[int, int], int]] = {}  # rel -> (source key, re-copies)
        self._invalid: dict[str, Invalid] = {}
        # Committed primary files not yet mirrored -> since when (wall clock): the lag, whatever the
        # queue holds (a job dropped after a permanent error is still behind). Workers remove.
        self._unmirrored: dict[str, float] = {}
        self._lock = threading.Lock()
        self.log = get_logger()

    # -- outcomes (worker threads) ---------------------------------------------------------------
    def record(self, job: CopyJob, outcome: CopyResult | MirrordError) -> bool:
        """Account for one finished job; True when the primary should be reconciled again soon."""
        with self._lock:
            if isinstance(outcome, CopyResult | SourceGoneError):  # (rotated away: no checkpoint waits, no lag)
                self._unmirrored.pop(job.rel, None)
            if isinstance(outcome, CopyResult):
                self._invalid.pop(job.rel, None)
            elif isinstance(outcome, InvalidSourceError):  # usually a file still being written: wait until
                was = self._invalid.get(job.rel)  # it changes and settles again
                self._invalid[job.rel] = Invalid(
                    outcome.identity,
                    was.since if was else self.monotonic(),
                    outcome.status,
                    outcome.cause,
                    bool(was and was.reported),
                    frozenset(job.paths),
                )
                # A torn newest step no longer retires the step before it: reconcile, so that one is copied.
                return True
        if isinstance(outcome, CopyResult):
            self.copied += 1
            self.verify_failed.discard(job.rel)
        elif not isinstance(outcome, SourceGoneError) and outcome.reason != "cancelled":
            self.failed += 1
            self.last_error = f"{job.rel}: {outcome.cause}"
            if isinstance(outcome, MirrorGoneError):
                self.refusals.note(IDENTITY, outcome.cause)  # logged by the next heartbeat's check
        return False

    # -- invalid sources -------------------------------------------------------------------------
    def invalid_paths(self) -> frozenset[str]:
        """Primary files that failed their validator as they are now."""
        with self._lock:
            return frozenset(self._invalid)

    def invalid_files(self) -> frozenset[str]:
        """The primary files of every invalid source (a folder unit's, each of them): retention's input."""
        with self._lock:
            return frozenset(rel for invalid in self._invalid.values() for rel in invalid.files)

    def judged_invalid(self, rel: str, identity: Hashable | None) -> bool:
        """Whether `rel` (a file or a folder unit) failed its validator as it is now (same identity):
        not read again until it changes."""
        with self._lock:
            invalid = self._invalid.get(rel)
        return invalid is not None and invalid.identity is not None and identity == invalid.identity

    def forget_invalid(self, rel: str) -> None:
        """`rel` is gone from the primary: forget its verdict."""
        with self._lock:
            self._invalid.pop(rel, None)

    def keep_invalid(self, present: Collection[str]) -> None:
        """A complete listing: forget the verdicts, re-copy counts and loops of sources no longer on the primary."""
        with self._lock:
            for memo in (self._invalid, self._recopies, self.looping):
                for rel in [rel for rel in memo if rel not in present]:
                    del memo[rel]

    def report_invalid(self, grace: float) -> None:
        """A source still invalid after copy.invalid_grace_seconds is not being written: say so once."""
        now = self.monotonic()
        with self._lock:
            items = list(self._invalid.items())
        for rel, invalid in items:
            if not invalid.reported and now - invalid.since >= grace:
                invalid.reported = True
                self.metrics.copy_result("invalid_source")
                self.log.error(
                    "copy.invalid_source",
                    path=rel,
                    reason=invalid.status,
                    cause=invalid.cause,
                    seconds_invalid=round(now - invalid.since, 1),
                    published=False,
                )
        self.metrics.invalid_sources.set(sum(i.reported for _, i in items))

    # -- lag -------------------------------------------------------------------------------------
    def behind(self, jobs: Iterable[CopyJob], replace: bool, entries: Mapping[str, ManifestEntry]) -> None:
        """Remember since when each of `jobs` lacks its mirror copy (the lag gauge reads this)."""
        now = self.wall()
        with self._lock:
            behind = {} if replace else self._unmirrored
            for job in jobs:
                entry = entries.get(job.rel)
                if (
                    entry is not None
                    and (entry.size, entry.source_mtime_ns) == (job.size, job.mtime_ns)
                    and job.why not in VERIFY_FAILURES
                ):
                    continue  # copied and recorded since the plan was made
                since = job.waiting_since(now)
                behind[job.rel] = min(since, self._unmirrored.get(job.rel, since))
            self._unmirrored = behind

    def lag(self, pending: Iterable[QueuedJob]) -> float:
        """Seconds the oldest unmirrored file (or the longest-queued job) has been waiting."""
        now_wall, now_mono = self.wall(), self.monotonic()
        queued = max((now_mono - entry.first_seen for entry in pending), default=0.0)
        with self._lock:
            oldest = min(self._unmirrored.values(), default=now_wall)
        return max(queued, now_wall - oldest)

    # -- damage and loops ------------------------------------------------------------------------
    def damaged(self, job: CopyJob) -> None:
        """The manifest vouches for a copy that is gone or no longer what was recorded: count it once per
        damage (until a fresh copy is recorded); the job repairs it by copying again."""
        if job.rel in self.verify_failed:
            return
        self.verify_failed.add(job.rel)
        self.metrics.verify_failures.inc()
        self.log.warning("mirror.verify_failed", path=job.rel, run=job.run or ".", step=job.step, why=job.why)

    def copy_loops(self, job: CopyJob) -> bool:
        """Count re-copies of the same source version; past RECOPY_LIMIT it is a problem, not a job."""
        key = (job.size, job.mtime_ns)
        if job.rel in self.looping:
            if self.looping[job.rel] == key:
                return True
            del self.looping[job.rel]  # its source changed: a job again
        if job.why not in VERIFY_FAILURES:
            self._recopies.pop(job.rel, None)
            return False
        previous, count = self._recopies.get(job.rel, (key, 0))
        count = count + 1 if previous == key else 1
        self._recopies[job.rel] = (key, count)
        if count <= RECOPY_LIMIT:
            return False
        self.looping[job.rel] = key
        self.log.error(
            "copy.loop",
            path=job.rel,
            run=job.run or ".",
            step=job.step,
            copies=count - 1,
            why=job.why,
            action="not copied again until its source changes or mirrord restarts",
            hint="the mirror does not keep what was written (timestamps, a filter, a sync tool?)",
        )
        return True

    def status(self, queue_depth: int, unsettled: int) -> str:
        """The one-line status for systemd and the log."""
        with self._lock:
            invalid = len(self._invalid)
        status = (
            f"{self.copied} copied, {self.failed} failed, queue {queue_depth}, unsettled {unsettled}, invalid {invalid}"
        )
        if self.refusals.blocked:
            status += f"; REFUSED: {self.refusals.blocked}"
        elif self.last_error:
            status += f"; last error: {self.last_error}"
        if self.looping:
            status += f"; {len(self.looping)} file(s) re-copied in a loop, not copied again"
        return status
