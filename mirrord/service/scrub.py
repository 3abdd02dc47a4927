"""The scrub: every copy on the mirror read again against its recorded hash, the whole mirror once per
`scrub.interval_days`, its bytes spread over the interval, at the copies' I/O and CPU priority, and only
while no copy is queued or running (the trainer's checkpoints come first).

    copies whose stat changed since recorded (unconfirmed) first, then the rest -> check_entry (`verify`'s)
      match     -> the record takes the copy's current stat: confirmed, counted by retention again
      mismatch  -> the primary holds the recorded bytes (hashed)? copied again, through the daemon's queue
                   else kept as it is (never deleted): scrub.damaged, mirrord_damaged_copies

An object store is scrubbed only with `scrub.s3` (every object downloaded again: egress is billed, and the
store keeps checksums of its own); this node's own entries only, and an object the store did not serve is
judged at the next pass (an outage is no damage). What it finds that no listing can: bytes rotted on the
store's disks under an unchanged size, LastModified and ETag.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mirrord.config import DAY, Config
from mirrord.core.jobs import CopyJob
from mirrord.core.model import ManifestEntry
from mirrord.core.nodes import foreign
from mirrord.errors import MirrordError
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.service.copier import CopyControl, hash_source
from mirrord.service.pacing import Pacer
from mirrord.service.workers import lower_priority
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.resume import check_entry
from mirrord.store.volume import stat_safely

BUSY_POLL_SECONDS = 1.0


class _StopError(Exception):
    """The daemon is stopping: the file being read is left unjudged."""


class Scrubber:
    """The scrub's thread. `busy()`: a copy is queued or running; `in_flight()`: the paths being copied;
    `repair(job)`: queue a copy of a damaged file whose source still holds its recorded bytes."""

    def __init__(
        self,
        config: Callable[[], Config],
        mirror: Mirror,
        manifest: Manifest,
        metrics: Metrics,
        in_flight: Callable[[], frozenset[str]],
        busy: Callable[[], bool],
        repair: Callable[[CopyJob], None],
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        pacer: Pacer | None = None,
    ) -> None:
        self.config, self.mirror, self.manifest, self.metrics = config, mirror, manifest, metrics
        self.in_flight, self.busy, self.repair, self.wall, self.monotonic = in_flight, busy, repair, wall, monotonic
        self.local = mirror.local_tree() is not None  # (else an object store)
        self.damaged: dict[str, ManifestEntry] = {}  # path -> the record it fails (forgotten once that changes)
        metrics.damaged_copies.set_function(lambda: len(self.damaged))
        self.log = get_logger()
        # (the control stops a read of the primary, and the pacer's waits)
        self._stopping, self._control = threading.Event(), CopyControl(pacer=pacer)
        self._opened, self._read = 0.0, 0  # when the file being read was opened, and how much of it is read
        self.thread = threading.Thread(target=self._run, name="mirrord-scrub", daemon=True)

    def start(self) -> None:
        """Scrub from now on (an object store only while scrub.s3 is on: said here when it is not)."""
        if not self.local and not self.config().scrub.s3:
            self.log.info(
                "scrub.off",
                mirror=self.mirror.describe(),
                reason="an object store is read back only with scrub.s3 = true (egress is billed; the store keeps "
                "checksums of its own); every rescan still compares each object's size and LastModified",
            )
        self.thread.start()

    def stop(self) -> None:
        """End the scrub at its next read (a read stuck on a hung mount is not waited for: a daemon thread)."""
        self._stopping.set()
        self._control.stop("cancelled")
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def _run(self) -> None:
        io = self.config().io
        lower_priority(io.ionice, io.cpu_nice, io.cpu_policy)
        while not self._stopping.is_set():
            scrub = self.config().scrub  # (a reload takes effect at the next pass)
            seconds = scrub.interval_days * DAY if self.local or scrub.s3 else 0
            if not seconds:
                self._stopping.wait(60)
                continue
            started = self.monotonic()
            try:
                self.scrub_pass(seconds)
            except _StopError:
                return
            self.metrics.scrub_last_complete.set(self.wall())
            self.log.info("scrub.finished", files=len(self.manifest), damaged=len(self.damaged))
            self._stopping.wait(started + seconds - self.monotonic())

    def scrub_pass(self, seconds: float) -> None:
        """Read every recorded copy once, over `seconds`: those whose stat changed first."""
        entries = {rel: e for rel, e in self.manifest.entries.items() if not foreign(e, self.mirror.node)}
        unconfirmed = {
            rel
            for rel, e in entries.items()
            if (state := stat_safely(self.mirror, rel)) is None or not e.unchanged(state)
        }
        rate, started, done = max(1, sum(e.size for e in entries.values())) / seconds, self.monotonic(), 0
        for rel in sorted(entries, key=lambda rel: (rel not in unconfirmed, rel)):
            # Each file waits for its turn (a file is never held open to spread its own bytes: a pruned
            # copy's space would stay allocated); after a wait for copies, the pass catches up.
            if self._stopping.wait(started + done / rate - self.monotonic()):
                raise _StopError
            done += entries[rel].size
            try:
                self._scrub(entries[rel])
            except MirrordError as exc:  # (the manifest could not record a confirmation): the next pass tries again
                self.log.error("scrub.failed", path=exc.path, cause=exc.cause)
        self.damaged = {rel: e for rel, e in self.damaged.items() if self.manifest.get(rel) == e}

    def _pace(self, n: int) -> None:
        """After `n` bytes read: wait while a copy is queued or running, while others need the device (the
        copies' pacer), and within the copies' bandwidth limit (io.bandwidth_limit)."""
        while self.busy() and not self._stopping.is_set():
            self._stopping.wait(BUSY_POLL_SECONDS)
        if self._control.pacer is not None:
            self._control.pacer.pace(self._control)
        self.metrics.scrub_bytes.inc(n)
        self._read += n
        limit = self.config().io.bandwidth_limit
        if self._stopping.wait(self._opened + self._read / limit - self.monotonic() if limit else 0):
            raise _StopError

    def _scrub(self, entry: ManifestEntry) -> None:
        self._pace(0)
        self._opened, self._read = self.monotonic(), 0
        before = stat_safely(self.mirror, entry.path)
        finding = check_entry(self.mirror, entry, self._pace, self.config().io.drop_cache and self.local)
        after = stat_safely(self.mirror, entry.path)
        if self.manifest.get(entry.path) != entry or entry.path in self.in_flight() or before != after:
            return  # copied again, retired or changed meanwhile: judged at the next pass
        if finding is not None and finding.problem == "unreadable" and not self.local:
            self.log.warning("scrub.failed", path=entry.path, cause=finding.detail)  # (the store did not answer)
            return
        if finding is None:
            self.damaged.pop(entry.path, None)
            if after is not None and not entry.unchanged(after):
                self.manifest.apply(
                    puts=[
                        replace(
                            entry, mirror_mtime_ns=after.mtime_ns, mirror_ino=after.ino, mirror_ctime_ns=after.ctime_ns
                        )
                    ]
                )
                self.log.info("scrub.confirmed", path=entry.path)
            return
        job = self._repair_job(entry)
        if job is not None:
            self.log.warning("scrub.recopy", path=entry.path, problem=finding.problem, detail=finding.detail)
            self.repair(job)
        elif entry.path not in self.damaged:
            # Its record forgets the copy's identity: `latest` then reads it again rather than trust its stat.
            kept = replace(entry, mirror_ino=0)
            self.manifest.apply(puts=[kept])
            self.damaged[entry.path] = kept
            self.log.error(
                "scrub.damaged",
                path=entry.path,
                problem=finding.problem,
                detail=finding.detail,
                action="kept as it is: the primary no longer holds the recorded bytes",
            )

    def _repair_job(self, entry: ManifestEntry) -> CopyJob | None:
        """The copy that repairs `entry` (its whole folder unit, for a member of one), if the primary still
        holds the recorded bytes; else None."""
        config = self.config()
        try:
            st, digest = hash_source(
                Path(config.primary), entry.path, entry.algo, config.io.buffer_bytes, self._control
            )
        except MirrordError:
            if self._stopping.is_set():
                raise _StopError from None
            return None  # gone, changed while read, unreadable: not the recorded bytes
        if (st.st_size, digest) != (entry.size, entry.digest):
            return None
        if not entry.unit:
            return CopyJob(entry.path, entry.size, st.st_mtime_ns, entry.step, "mirror_mismatch")
        unit = {rel: e for rel, e in self.manifest.entries.items() if e.unit == entry.unit}
        size = sum(e.size for e in unit.values())
        mtime = max(e.source_mtime_ns for e in unit.values())
        return CopyJob(entry.unit, size, mtime, entry.step, "mirror_mismatch", tuple(sorted(unit)))
