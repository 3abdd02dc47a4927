"""Copy one committed checkpoint to the mirror: stream, hash, verify, publish. Readable in a minute.

    open source (O_NOFOLLOW, beneath the root) -> fstat -> check free space -> NAME.part (exclusive)
    -> stream + hash + validate the same buffer -> source whole? -> seal (mtime, fsync, size)
    -> source unchanged? -> publish

Any failure removes NAME.part and raises a typed error naming the path and the cause; the final name
is only ever created by the rename of a complete, fsynced, verified file.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mirrord.core.jobs import CopyResult
from mirrord.errors import (
    CancelledError,
    InvalidSourceError,
    MirrordError,
    NoSpaceError,
    PermanentError,
    SourceChangedError,
    SourceGoneError,
    StalledError,
    from_oserror,
)
from mirrord.formats.validators import Validator, Verdict, new_validator
from mirrord.obs.sizes import bytes_both
from mirrord.paths import lstat_beneath, open_file_beneath
from mirrord.store.atomic import DirSyncs
from mirrord.store.hashing import new_hasher
from mirrord.store.mirror import Upload, UploadTarget

if TYPE_CHECKING:
    from mirrord.service.pacing import Pacer

_DROP_BEHIND_BYTES = 64 * 1024 * 1024


@dataclass
class CopyControl:
    """Shared between a copy and whoever supervises it (stall watchdog, shutdown).

    The copy publishes its progress; the supervisor may ask it to stop at the next chunk boundary.
    """

    clock: Callable[[], float] = time.monotonic
    bytes_done: int = 0
    last_progress: float = field(default=0.0)
    stop_reason: str | None = None  # "stalled" | "cancelled"
    pacer: Pacer | None = None  # shared by the process's copies: between buffers, backs off for others
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stopped: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self.last_progress = self.clock()

    def advance(self, n: int) -> None:
        """`n` more bytes copied: progress for the stall detector and the progress board."""
        self.bytes_done += n
        self.last_progress = self.clock()

    def stop(self, reason: str) -> None:
        """Ask the copy to stop at its next chunk (`stalled` or `cancelled`); the first reason wins."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        self._stopped.set()

    def pause(self, seconds: float) -> None:
        """Wait `seconds` (the pacer's or the bandwidth cap's pause), ending early when the copy is asked to stop."""
        self._stopped.wait(seconds)

    def check(self, path: Path) -> None:
        """Raise StalledError or CancelledError if the copy was asked to stop."""
        if self.stop_reason == "stalled":
            raise StalledError(path, "no progress for too long; copy abandoned")
        if self.stop_reason is not None:
            raise CancelledError(path, "copy aborted: mirrord is shutting down")


@dataclass(frozen=True)
class CopyOptions:
    """How copies are made: hash, buffer size, reserve, bandwidth limit, page-cache dropping."""

    algo: str = "blake3"
    buffer_bytes: int = 8 * 1024 * 1024
    reserve_bytes: int = 0
    bandwidth_limit: int = 0  # bytes/s, 0 = unlimited
    drop_cache: bool = False
    validate: bool = True  # run the format validator on the streamed bytes (mirrord.formats.validators)
    allow_empty: bool = False  # a 0-byte file is whole (a file of a folder unit: a marker, an empty list)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Same inode, size, mtime and ctime: ctime also catches a same-size rewrite whose mtime was restored."""
    return all(getattr(a, k) == getattr(b, k) for k in ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns"))


def copy_file(
    primary_root: Path,
    rel: str,
    mirror: UploadTarget,
    options: CopyOptions,
    control: CopyControl | None = None,
    dirs: DirSyncs | None = None,
    expect: os.stat_result | None = None,
) -> CopyResult:
    """Publish primary_root/rel on the mirror under the same relative path, or raise and leave no trace.

    With `dirs`, the directory fsync that makes the new name durable is left to dirs.flush() (group
    commit: mirrord.service.commits); the copy must not be recorded before that flush returned.
    `expect`: the file as the caller judged it (read and checked its bytes): anything else is not copied."""
    control = control or CopyControl()
    src_path = primary_root / rel
    started = time.monotonic()
    try:
        src_fd = open_file_beneath(primary_root, rel)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermanentError(src_path, "is a symlink or lies below one; not copied") from exc
        if exc.errno == errno.ENOENT:  # the file, or the folder it was in
            raise SourceGoneError(src_path, "deleted before it was copied (rotated away by the trainer)") from exc
        raise from_oserror(src_path, exc, "open source") from exc
    upload: Upload | None = None
    where: object = src_path  # the side an OSError concerns: the source until the mirror is touched
    try:
        before = os.fstat(src_fd)
        if not stat.S_ISREG(before.st_mode):
            raise PermanentError(src_path, "not a regular file; not copied")
        if expect is not None and not _same_file(expect, before):
            raise SourceChangedError(src_path, "rewritten since it was checked; not copied")
        # A source with holes (rare for checkpoints): only its data is written, so the copy is as sparse as it.
        data = _data_segments(src_fd) if before.st_blocks * 512 < before.st_size else deque([(0, before.st_size)])
        where = mirror.describe(rel)
        space = mirror.space()  # None: the store does not know (an object store), nothing to check
        if space is not None and space[0] < before.st_size + options.reserve_bytes:
            raise NoSpaceError(
                where,
                f"mirror has {bytes_both(space[0])} free; needs {bytes_both(before.st_size)} "
                f"plus the reserve of {bytes_both(options.reserve_bytes)} (copy.free_space_reserve_bytes)",
            )
        upload = mirror.begin_upload(rel, before.st_size, options.drop_cache)
        digest, verdict = _stream(src_fd, before.st_size, upload, options, control, src_path, rel, data)
        control.check(src_path)
        if options.allow_empty and before.st_size == 0:
            verdict = Verdict("unchecked", "0 bytes (a file of a folder unit)")
        if not verdict.passed:
            _check_unchanged(primary_root, rel, src_fd, before, src_path)  # judge the file as it is now
            raise InvalidSourceError(
                src_path,
                f"not a whole checkpoint ({verdict}); not published",
                verdict.status,
                (before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns),
            )
        stored_mtime_ns = upload.seal(before.st_mtime_ns)
        _check_unchanged(primary_root, rel, src_fd, before, src_path)
        control.check(src_path)
        published_mtime_ns = upload.commit(dirs)  # an object store knows its LastModified only now
        upload = None
        if published_mtime_ns is not None:
            stored_mtime_ns = published_mtime_ns
    except MirrordError:
        raise
    except OSError as exc:
        raise from_oserror(where, exc, "copy") from exc
    finally:
        if upload is not None:
            upload.abort()
        os.close(src_fd)
    return CopyResult(
        rel,
        before.st_size,
        options.algo,
        digest,
        before.st_mtime_ns,
        time.monotonic() - started,
        stored_mtime_ns,
        verdict.status,
        verdict.detail,
        (before.st_dev, before.st_ino, before.st_ctime_ns),
    )


def hash_source(
    primary_root: Path, rel: str, algo: str, buffer_bytes: int, control: CopyControl | None = None
) -> tuple[os.stat_result, str]:
    """Read primary_root/rel once and hash it (no copy): its stat and digest, the file unchanged while read.
    Raises the copier's typed errors (SourceGoneError, SourceChangedError, ...)."""
    control = control or CopyControl()
    src_path = primary_root / rel
    try:
        src_fd = open_file_beneath(primary_root, rel)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise SourceGoneError(src_path, "deleted before it was read (rotated away by the trainer)") from exc
        raise from_oserror(src_path, exc, "open source") from exc
    try:
        before = os.fstat(src_fd)
        if not stat.S_ISREG(before.st_mode):
            raise PermanentError(src_path, "not a regular file; not copied")
        options = CopyOptions(algo, buffer_bytes, validate=False)
        digest, _ = _stream(src_fd, before.st_size, None, options, control, src_path, rel, deque())
        _check_unchanged(primary_root, rel, src_fd, before, src_path)
    finally:
        os.close(src_fd)
    return before, digest


def _check_unchanged(primary_root: Path, rel: str, src_fd: int, before: os.stat_result, src_path: Path) -> None:
    try:
        now = lstat_beneath(primary_root, rel)
    except OSError as exc:
        raise SourceChangedError(
            src_path, f"gone while it was being copied ({exc.strerror or exc}); copy discarded"
        ) from exc
    if now is None:
        raise SourceGoneError(
            src_path, "deleted while it was being copied (rotated away by the trainer); copy discarded"
        )
    if not (_same_file(before, os.fstat(src_fd)) and _same_file(before, now)):
        raise SourceChangedError(src_path, "changed while it was being copied; copy discarded")


def _data_segments(src_fd: int) -> deque[tuple[int, int]]:
    """Where a source with holes holds data (SEEK_DATA/SEEK_HOLE): (start, end) of each segment, in order."""
    segments: deque[tuple[int, int]] = deque()
    end = 0
    while True:
        try:
            start = os.lseek(src_fd, end, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left up to the end
                break
            raise
        end = os.lseek(src_fd, start, os.SEEK_HOLE)
        segments.append((start, end))
    os.lseek(src_fd, 0, os.SEEK_SET)  # the copy reads from the start
    return segments


def _stream(
    src_fd: int,
    size: int,
    upload: Upload | None,
    options: CopyOptions,
    control: CopyControl,
    src_path: Path,
    rel: str,
    data: deque[tuple[int, int]],
) -> tuple[str, Verdict]:
    """Read, hash, validate and write the same bytes until EOF, `size` bytes (else SourceChangedError);
    returns (digest, verdict).

    Each buffer is read once, then hashed on this thread while a helper thread feeds the same bytes to the
    validator and writes them (zlib/isal, blake3 and write release the GIL). Two buffers take turns, so the
    next read and hash overlap the previous buffer's write; a buffer is read into again only once its write
    returned. The helper is made by this thread, so it has its CPU and I/O priority. Only the bytes within the
    `data` segments are written (a dense source is one): a sparse source's holes read as zeros, are hashed and
    validated as such, and stay holes on the mirror. Without `upload`, the bytes are only hashed."""
    hasher = new_hasher(options.algo)
    validator = new_validator(rel, src_fd) if options.validate else None
    buffers = thread_buffers(options.buffer_bytes)
    in_flight: deque[Future[None]] = deque()
    failed: list[BaseException] = []  # set by the helper: the buffers queued after a failed one are dropped
    copied = dropped = turn = 0
    started = time.monotonic()
    with ThreadPoolExecutor(1, thread_name_prefix="mirrord-write") as helper:
        try:
            while True:
                control.check(src_path)
                if len(in_flight) == len(buffers):
                    in_flight.popleft().result()  # that buffer is free again (or its write's error is raised)
                buf = buffers[turn % len(buffers)]
                turn += 1
                n = _read(src_fd, buf, src_path)
                if n == 0:
                    break
                chunk = memoryview(buf)[:n]
                in_flight.append(helper.submit(_validate_and_write, validator, upload, chunk, copied, data, failed))
                hasher.update(chunk)
                copied += n
                control.advance(n)
                if options.drop_cache and copied - dropped >= _DROP_BEHIND_BYTES:
                    os.posix_fadvise(src_fd, dropped, copied - dropped, os.POSIX_FADV_DONTNEED)
                    dropped = copied
                if control.pacer is not None:
                    control.pacer.pace(control)
                if options.bandwidth_limit:
                    ahead = copied / options.bandwidth_limit - (time.monotonic() - started)
                    if ahead > 0:
                        control.pause(ahead)  # a stop (shutdown, Ctrl-C) must not wait out the cap
            while in_flight:
                in_flight.popleft().result()
        finally:
            for queued in in_flight:
                queued.cancel()
            wait(in_flight)  # no write may still use a buffer after this
    if copied != size:
        raise SourceChangedError(src_path, f"read {copied} bytes, expected {size}")
    if validator is not None:
        verdict = validator.finish(src_fd)
    elif copied == 0:
        verdict = Verdict("empty", "0 bytes: nothing was written (yet)")
    else:
        verdict = Verdict("unchecked", "validation is off (copy.validate = false)")
    if options.drop_cache:
        os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return hasher.hexdigest(), verdict


def _validate_and_write(
    validator: Validator | None,
    upload: Upload | None,
    chunk: memoryview,
    at: int,
    data: deque[tuple[int, int]],
    failed: list[BaseException],
) -> None:
    """Feed the validator `chunk`, the source's bytes from offset `at`, and write those within the `data`
    segments (the others are left holes)."""
    if failed:
        return  # an earlier buffer failed: the copy is being abandoned, nothing more is written
    try:
        if validator is not None:
            validator.feed(chunk, len(chunk))
        if upload is None:
            return
        end, pos = at + len(chunk), at
        while data and data[0][0] < end:
            start, stop = data[0]
            if start > pos:
                upload.skip(start - pos)
            pos = min(stop, end)
            upload.write(chunk[max(start, at) - at : pos - at])
            if stop > end:
                break
            data.popleft()  # written whole
        if pos < end:
            upload.skip(end - pos)
    except BaseException as exc:
        failed.append(exc)
        raise


_BUFFERS = threading.local()


def thread_buffers(total_bytes: int) -> list[bytearray]:
    """The calling thread's two copy buffers, `total_bytes` together (io.buffer_bytes), kept for its next
    copy: fresh ones cost a page fault and a zeroed page per 4 KiB, which slows a run of small copies
    measurably."""
    half = max(64 * 1024, total_bytes // 2)
    buffers: list[bytearray] | None = getattr(_BUFFERS, "pair", None)
    if buffers is None or len(buffers[0]) != half:
        buffers = _BUFFERS.pair = [bytearray(half), bytearray(half)]
    return buffers


def release_thread_buffers() -> None:
    """Give the calling thread's copy buffers back (a worker with nothing to do)."""
    _BUFFERS.pair = None


def _read(src_fd: int, buf: bytearray, src_path: Path) -> int:
    """One read of the source into `buf`; its error names the source."""
    try:
        return os.readv(src_fd, [buf])
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):  # a file deleted under its reader on FUSE, NFS
            raise SourceGoneError(src_path, "deleted while it was being copied (rotated away by the trainer)") from exc
        raise from_oserror(src_path, exc, "read source") from exc
