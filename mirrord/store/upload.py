"""A file published on a local mirror: NAME.part in the destination directory, written with write-behind,
sealed (mtime, fsync, size) and renamed onto NAME through mirrord.store.atomic."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from mirrord.errors import SizeMismatchError
from mirrord.paths import open_dir_beneath, split_rel
from mirrord.store import atomic

# Dirty data of a copy is written back in windows of this size while the copy runs, so the final fsync
# is short and the copy never builds a multi-GB dirty backlog that stalls the trainer's own writes.
WRITEBACK_WINDOW = 64 * 1024 * 1024
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE)  # sync_file_range on this filesystem
# A file up to this size leaves its fsync to commit(): seal() writes its data out and waits for it (so
# drop_cache frees its pages for the next copy at once, and a data error is reported to this copy), but
# not for the filesystem's journal nor the device's cache flush; copies committed together
# (mirrord.service.commits) are then made durable together, one syncfs for the group instead of an fsync
# (a journal commit and a cache flush) per file (atomic.DirSyncs; bench/results/goals.md, goal 5).
# Larger files fsync in seal(), as they always did.
DEFER_FSYNC_MAX_BYTES = WRITEBACK_WINDOW


def _load_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """sync_file_range(2) through libc, or None where the platform lacks it."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if func(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return sync_file_range


# Looked up by the first copy, not at import (atomic.NotLoaded): a command that writes nothing never loads
# ctypes. None: no write-behind, the final fsync alone (tests set it).
_sync_file_range: Callable[[int, int, int, int], None] | atomic.NotLoaded | None = atomic.NotLoaded()


def _loaded_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """sync_file_range, looked up on the first call."""
    global _sync_file_range
    if isinstance(_sync_file_range, atomic.NotLoaded):
        _sync_file_range = _load_sync_file_range()
    return _sync_file_range


class LocalUpload:
    """NAME.part in the destination directory, created exclusively; see mirrord.store.atomic."""

    def __init__(self, root: Path, rel: str, size: int, drop_cache: bool = False, modes: tuple[int, ...] = ()) -> None:
        parts = split_rel(rel)
        self.path = root / rel
        self.name = parts[-1]
        self.expected_size = size
        self.drop_cache = drop_cache
        self.written = 0
        self._flushed = 0  # bytes below this offset are written back (and dropped when drop_cache)
        self._writeback = _loaded_sync_file_range()
        self._sealed = False
        self._unsynced = False  # sealed with its data written out, the fsync left to commit()
        self._hole_at_end = False
        self._dir_fd = open_dir_beneath(root, parts[:-1], create=True, modes=modes)
        try:
            self._fd = atomic.create_temp(self._dir_fd, self.name, modes[-1] if len(modes) == len(parts) else 0o644)
        except BaseException:
            os.close(self._dir_fd)
            raise

    def write(self, data: memoryview) -> None:
        """Write `data` at the end of the temp file."""
        self._hole_at_end = False
        start = self.written
        while data:
            n = os.write(self._fd, data)
            self.written += n
            data = data[n:]
        self._write_behind(start)

    def skip(self, nbytes: int) -> None:
        """Leave a hole of `nbytes` (zeros that take no space): a sparse source stays sparse."""
        os.lseek(self._fd, nbytes, os.SEEK_CUR)
        self.written += nbytes
        self._hole_at_end = nbytes > 0

    def _write_behind(self, start: int) -> None:
        """With drop_cache: start writeback of what was just written; while two windows are pending,
        wait for the older one and drop it from the page cache. Not a durability step: seal() fsyncs.

        Without drop_cache the pages stay cached anyway, and waiting window by window only slowed the
        copy (bench/results/copy_strategies.md), so the final fsync does all the writing then."""
        if self._writeback is None or not self.drop_cache:
            return
        try:
            self._writeback(self._fd, start, self.written - start, _SFR_WRITE)
            while self.written - self._flushed >= 2 * WRITEBACK_WINDOW:  # one write may span several windows
                flags = _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER
                self._writeback(self._fd, self._flushed, WRITEBACK_WINDOW, flags)
                os.posix_fadvise(self._fd, self._flushed, WRITEBACK_WINDOW, os.POSIX_FADV_DONTNEED)
                self._flushed += WRITEBACK_WINDOW
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            self._writeback = None  # this filesystem does not support it; the final fsync suffices

    def seal(self, mtime_ns: int) -> int:
        """Give the copy the source's mtime, make it durable, and check its size; returns the mtime the
        filesystem actually stored (it may clamp or round it). A file of at most DEFER_FSYNC_MAX_BYTES
        only has its data written out here: its fsync is made by commit(), before the rename.

        If fsync fails the kernel may already have dropped the dirty pages, so retrying fsync could
        report success for lost data: the caller must abort and rebuild from the source.
        """
        if self._hole_at_end:
            os.ftruncate(self._fd, self.written)  # a trailing hole: skip() moved the offset only
        os.utime(self._fd, ns=(mtime_ns, mtime_ns))
        # Written out (its data errors reported here) and clean, or fsynced now.
        self._unsynced = self.written <= DEFER_FSYNC_MAX_BYTES and self._write_out()
        if not self._unsynced:
            atomic.sync(self._fd)
        st = os.fstat(self._fd)
        size = st.st_size
        if size != self.expected_size or self.written != self.expected_size:
            raise SizeMismatchError(
                self.path, f"wrote {self.written} bytes, file has {size}, source had {self.expected_size}"
            )
        if self.drop_cache:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._sealed = True
        return st.st_mtime_ns

    def _write_out(self) -> bool:
        """Write the file's data to the device and wait for it, but not for the filesystem's journal (not
        a durability step: the fsync made later commits the metadata, for a whole group at once). Its
        pages are then clean, so drop_cache can free them now, for the next copy to reuse: True. False
        where the filesystem cannot (seal() then fsyncs at once)."""
        if self._writeback is None:
            return False
        try:
            self._writeback(self._fd, 0, 0, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            return False
        return True

    def commit(self, dirs: atomic.DirSyncs | None = None) -> None:
        """Publish the sealed temp file under its final name (fsync if seal() left it, rename, then fsync
        of the folder), or with `dirs` leave that to dirs.flush(): the folder's fsync, and a file's own
        fsync and rename if seal() left its fsync (atomic.DirSyncs.publish_later)."""
        if not self._sealed:
            raise RuntimeError("commit() before seal()")
        if self._unsynced and dirs is not None:
            dirs.publish_later(self._dir_fd, self.name, self._fd)
            self._fd = self._dir_fd = -1  # the group's now
            return
        try:
            if self._unsynced:
                atomic.sync(self._fd)
            atomic.publish(self._dir_fd, self.name, self._fd, dirs)
        except BaseException:
            atomic.discard_temp(self._dir_fd, self.name, self._fd)
            raise
        finally:
            self._close()

    def abort(self) -> None:
        """Remove the temp file (only ours: checked by inode); the final name is untouched."""
        if self._fd >= 0:
            atomic.discard_temp(self._dir_fd, self.name, self._fd)
            self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._dir_fd)
            self._fd = self._dir_fd = -1
