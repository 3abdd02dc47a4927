"""Group commit of finished copies: the stage between the copy workers and the manifest.

    worker: NAME.part -> write -> fsync file -> rename onto NAME        (each copy, in its own worker)
            (a small file: write -> write its data out and wait; fsync and rename left to the stage)
    commit stage: gather copies that finish together (a short window, or until nothing else is being
    copied) -> make the small files durable (one syncfs for several) and rename them -> fsync each of
    their directories once (one syncfs for several) -> one journal record (one append, one fsync)
    -> each copy counts: logged copy.committed, handed to on_done

A copy is never recorded before its data and its name are durable, and a crash anywhere leaves what a
crash between the same steps of a single copy leaves: a published name not yet recorded, which the next
reconcile copies again; a small file is renamed only once it is durable, so a crash before that leaves
no final name for it. Batching only spares fsyncs: one per directory (or one syncfs) and one of the
journal per batch, instead of one of each per copy, and for small files one syncfs instead of an fsync
each (mirrord.store.atomic.DirSyncs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from mirrord.core.jobs import CopyResult
from mirrord.errors import MirrordError
from mirrord.obs.log import get_logger
from mirrord.service.copier import CopyControl
from mirrord.service.engine import StagedCopy
from mirrord.service.jobqueue import QueuedJob

# How long the first copy of a batch may wait for others. Short next to a copy's own time, long enough
# for the copies running beside it to finish: a lone copy (nothing else being copied) never waits.
COMMIT_WINDOW_SECONDS = 0.5
# Copies waiting for a commit at most; a worker that finishes another then waits (each holds a
# directory descriptor open until its batch is committed).
MAX_PENDING = 256

Outcome = CopyResult | MirrordError
Pending = tuple[QueuedJob, StagedCopy, CopyControl]


class CommitStage:
    """One thread that commits staged copies in batches (see the module docstring).

    `commit(batch)` makes a batch durable and recorded and returns each copy's outcome, in order;
    `on_committed(entry, outcome, control)` is then called once per copy, from this thread. `busy()`
    says whether more copies are coming soon (a job being copied or ready to be): while it is false
    a batch is committed at once."""

    def __init__(
        self,
        commit: Callable[[Sequence[StagedCopy]], list[Outcome]],
        on_committed: Callable[[QueuedJob, Outcome, CopyControl], None],
        busy: Callable[[], bool],
    ) -> None:
        self._commit, self._on_committed, self._busy = commit, on_committed, busy
        self._cond = threading.Condition()
        self._pending: list[Pending] = []
        self._stopping = False
        self._committing_since: float | None = None
        self._committing: list[str] = []
        self.log = get_logger()
        self.thread = threading.Thread(target=self._run, name="mirrord-commit", daemon=True)
        self.thread.start()

    def submit(self, entry: QueuedJob, staged: StagedCopy, control: CopyControl) -> None:
        """Hand over a staged copy; waits while MAX_PENDING copies are already waiting."""
        with self._cond:
            while len(self._pending) >= MAX_PENDING and not self._stopping:
                self._cond.wait(timeout=1.0)
            self._pending.append((entry, staged, control))
            self._cond.notify_all()

    def wake(self) -> None:
        """Something that busy() reads changed (a worker went idle): a waiting batch may go now."""
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float) -> bool:
        """Commit what was handed over, then end the thread; True if it ended within `timeout`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def problem(self, stall_seconds: float) -> str | None:
        """A commit under way for longer than stall_seconds (a directory or journal fsync hung in the
        kernel: a hung mount), else None."""
        with self._cond:
            since, paths = self._committing_since, list(self._committing)
        if since is None or (took := time.monotonic() - since) < stall_seconds:
            return None
        return f"commit of {len(paths)} copies ({', '.join(paths[:3])}) under way for {took:.0f} s"

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    return
                opened = time.monotonic()
                while len(self._pending) < MAX_PENDING and not self._stopping and self._busy():
                    left = opened + COMMIT_WINDOW_SECONDS - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(timeout=left)
                batch, self._pending = self._pending, []
                self._committing_since = time.monotonic()
                self._committing = paths = [entry.job.rel for entry, _, _ in batch]
                self._cond.notify_all()  # submitters waiting for room
            try:
                outcomes = self._commit([staged for _, staged, _ in batch])
            except Exception as exc:  # a bug must not strand the batch: every copy gets an outcome
                self.log.exception("commit.crashed", paths=paths)
                outcomes = [MirrordError(rel, f"internal error: {exc!r}") for rel in paths]
            finally:
                with self._cond:
                    self._committing_since, self._committing = None, []
            for (entry, _, control), outcome in zip(batch, outcomes, strict=True):
                self._on_committed(entry, outcome, control)
