"""The durability protocol, and nothing else. Every name mirrord publishes goes through here.

    temp name in the same directory -> write -> fsync file -> verify -> os.replace -> fsync directory

A reader (or a resume after a power cut) sees either the old file or the whole new one, never a prefix.

Group commit: copies that finish together may share their directory fsyncs. publish() then leaves the
directory to a DirSyncs, whose flush() fsyncs each directory once for all the renames made in it; until
that flush returns, the new names are not durable and nothing may record or announce them. A small file
may leave its own fsync and rename to the group too (publish_later): flush() then makes every such file
durable first, renames them only once that returned, then makes the directories durable. Several files
(or directories) on one filesystem are made durable by one syncfs instead of an fsync each: each fsync
waits for a flush of the device's cache of its own, and on a virtual disk that flush costs more than
writing a 4 MiB checkpoint. A failure before the renames discards the temp files: no final name ever
names data that is not durable.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from mirrord.paths import DIR_FLAGS
from mirrord.paths import TEMP_SUFFIX as TEMP_SUFFIX  # (re-exported: the store's users name it here)

ASIDE_SUFFIX = ".old.part"  # an old copy of a folder renamed aside where names cannot be exchanged
# Folder units are staged (and retired) here, at the mirror root, never beside their final name: a
# trainer's own checkpoint picker lists the run folder and would take `checkpoint_12.part/` for a step.
STAGING_AREA = ".mirrord-staging"
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _load_syncfs() -> Callable[[int], None] | None:
    """syncfs(2) through libc where it reports every writeback error since the descriptor was opened
    (Linux 5.8 on); None elsewhere, where a group's files are fsynced one by one."""
    import ctypes

    system = os.uname()
    try:
        if system.sysname != "Linux" or tuple(int(x) for x in system.release.split(".")[:2]) < (5, 8):
            return None
        func = ctypes.CDLL(None, use_errno=True).syncfs
    except (ValueError, OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int]

    def syncfs(fd: int) -> None:
        if func(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return syncfs


class NotLoaded:
    """A libc function not looked up yet. syncfs here (and sync_file_range and fstatfs in
    mirrord.store.volume) are looked up on first use, not at import: most commands never commit a
    group nor write a copy, and `latest` should not pay for ctypes, platform and a libc lookup on every
    call."""


_syncfs: Callable[[int], None] | NotLoaded | None = NotLoaded()  # None: fsync one by one (tests set it)


def _group_syncfs() -> Callable[[int], None] | None:
    global _syncfs
    found = _syncfs
    if isinstance(found, NotLoaded):
        found = _syncfs = _load_syncfs()
    return found


def temp_name(final_name: str) -> str:
    """The in-progress name of `final_name`: a fixed suffix that discovery ignores."""
    return final_name + TEMP_SUFFIX


def temp_path(final: Path) -> Path:
    """The temporary name a file is written under before it is published as `final`."""
    return final.with_name(temp_name(final.name))


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a create, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Unpublished(NamedTuple):
    """A written, verified temp file whose fsync and rename are left to DirSyncs.flush(); the group owns
    both descriptors."""

    dir_fd: int
    final_name: str
    temp_fd: int


def _close_quietly(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class DirSyncs:
    """Directories with renames not yet made durable: flush() fsyncs each one once, however many
    renames it holds. A directory is held open (by a duplicate descriptor) until flushed or closed,
    so the fsync reaches the very directory the rename was made in, wherever it has moved since.
    Files handed over by publish_later() are fsynced and renamed by flush() first (module docstring)."""

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int], int] = {}
        self._files: list[_Unpublished] = []
        self._lock = threading.Lock()

    def renames_pending(self) -> bool:
        """Whether files handed over by publish_later() wait for flush() (their final names do not exist yet)."""
        with self._lock:
            return bool(self._files)

    def publish_later(self, dir_fd: int, final_name: str, temp_fd: int) -> None:
        """Leave the fsync of the written (its data written out, see LocalUpload.seal), verified temp file
        and its rename onto `final_name` to flush(); the group takes both descriptors (closed by flush()
        or close()). close() without flush() discards the temp file."""
        with self._lock:
            self._files.append(_Unpublished(dir_fd, final_name, temp_fd))

    def add(self, dir_fd: int) -> None:
        """A rename was made in the directory `dir_fd`: it must be fsynced before the rename counts."""
        st = os.fstat(dir_fd)
        with self._lock:
            if (st.st_dev, st.st_ino) not in self._fds:
                self._fds[(st.st_dev, st.st_ino)] = os.dup(dir_fd)

    def absorb(self, other: DirSyncs) -> None:
        """Take over every directory of `other` (which is left empty)."""
        with other._lock:
            taken, other._fds = other._fds, {}
            files, other._files = other._files, []
        with self._lock:
            self._files.extend(files)
            for key, fd in taken.items():
                if key in self._fds:
                    os.close(fd)
                else:
                    self._fds[key] = fd

    def flush(self) -> None:
        """fsync the files handed over by publish_later() and rename each onto its final name (none is
        renamed unless every fsync returned: a failure discards them all and is raised), then fsync
        every directory once and forget them (several files, or directories, on one filesystem: one
        syncfs for them all instead, see _make_durable). A failure is raised; a failed fsync is never
        retried: the renames it covered are not known durable."""
        self._publish_files()
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        try:
            _make_durable(fds)
        finally:
            _close_quietly(fds)

    def close(self) -> None:
        """Forget the directories without fsyncing them (the renames they hold will not be recorded);
        discard the temp files of publish_later() not yet renamed."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            files, self._files = self._files, []
        _close_quietly(fds)
        for f in files:
            discard_temp(f.dir_fd, f.final_name, f.temp_fd)
            _close_quietly((f.temp_fd, f.dir_fd))

    def _publish_files(self) -> None:
        """The files of publish_later(): every fsync first, then the renames (their directories join the
        group); a failure discards every temp file not yet renamed."""
        with self._lock:
            files, self._files = self._files, []
        renamed = 0
        try:
            _make_durable([f.temp_fd for f in files])
            for f in files:
                publish(f.dir_fd, f.final_name, f.temp_fd, self)
                renamed += 1
        except BaseException:
            for f in files[renamed:]:
                discard_temp(f.dir_fd, f.final_name, f.temp_fd)
            raise
        finally:
            for f in files:
                _close_quietly((f.temp_fd, f.dir_fd))


def _make_durable(fds: list[int]) -> None:
    """Make every file or directory durable (data, metadata, entries): fsync each, or for several, one
    syncfs per filesystem they are on. Each fsync waits for a device cache flush of its own; one syncfs
    flushes once for all, and reports any writeback error on that filesystem since the descriptor it
    is given was opened (a copy's own data errors were reported to it already, by the wait of
    sync_file_range in LocalUpload.seal). It also writes out whatever else is dirty on that filesystem:
    the price of sparing the flushes."""
    syncfs = _group_syncfs() if len(fds) >= 2 else None
    if syncfs is None:
        for fd in fds:
            os.fsync(fd)
        return
    first: dict[int, int] = {}  # per filesystem, the descriptor opened first: it reports the most errors
    for fd in fds:
        first.setdefault(os.fstat(fd).st_dev, fd)
    for fd in first.values():
        syncfs(fd)


def create_temp(dir_fd: int, final_name: str, mode: int = 0o644) -> int:
    """Create the temp file for `final_name` exclusively, replacing a stale one.

    A leftover temp of the same name is a dead writer's, or an abandoned (stalled) copy's that may still be
    alive (callers hold the mirror lock, or for a trainer own the path): that one checks by inode before it
    publishes or discards (_still_ours), so once its name is replaced here it touches nothing under it.
    """
    return os.open(_clear_temp(dir_fd, final_name), _CREATE_FLAGS, mode, dir_fd=dir_fd)


def discard_temp(dir_fd: int, final_name: str, temp_fd: int | None = None) -> None:
    """Remove the temp file; never raises, so it cannot mask the error that caused the discard.

    With `temp_fd`, the name is removed only if it still is that file: an abandoned (stalled) copy
    waking up late must not delete the temp file of the retry that replaced it.
    """
    with contextlib.suppress(OSError):  # (FileExistsError from _still_ours: not ours, left alone)
        os.unlink(temp_name(final_name) if temp_fd is None else _still_ours(dir_fd, final_name, temp_fd), dir_fd=dir_fd)


def publish(dir_fd: int, final_name: str, temp_fd: int, dirs: DirSyncs | None = None) -> None:
    """Rename the (already fsynced and verified) temp file onto its final name, then fsync the directory
    (with `dirs`, the directory is added to it instead: durable only once dirs.flush() returns).

    Refuses if the temp name no longer refers to the file we wrote (someone replaced it meanwhile).
    """
    name = _still_ours(dir_fd, final_name, temp_fd)
    os.replace(name, final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if dirs is None:
        os.fsync(dir_fd)
    else:
        dirs.add(dir_fd)


def publish_symlink(dir_fd: int, final_name: str, target: str) -> None:
    """Point `final_name` at `target` in one step: a symlink made under the temp name, renamed onto the
    final name, the directory fsynced."""
    name = _clear_temp(dir_fd, final_name)
    os.symlink(target, name, dir_fd=dir_fd)
    os.replace(name, final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def unlink_durably(dir_fd: int, name: str) -> None:
    """Remove a published name and fsync its directory: the deletion survives a power cut."""
    os.unlink(name, dir_fd=dir_fd)
    os.fsync(dir_fd)


def publish_new(dir_fd: int, final_name: str, temp_fd: int) -> None:
    """publish, but never over an existing file: FileExistsError if the final name exists.

    The final name is linked to the temp file, not renamed onto: a file that appeared a moment ago (a
    check-then-rename could clobber it) makes the link fail. Then the temp name is removed.
    """
    name = _still_ours(dir_fd, final_name, temp_fd)
    os.link(name, final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    os.unlink(name, dir_fd=dir_fd)
    os.fsync(dir_fd)


def exchange(dir_fd: int, a: str, b: str, b_dir_fd: int) -> bool:
    """Swap the names `a` (in dir_fd) and `b` (in b_dir_fd) in one step
    (renameat2 RENAME_EXCHANGE): each now names what the other did, and at no instant is either name
    missing. False, with nothing changed, where the kernel or the filesystem cannot (older kernels, some
    network and FUSE filesystems); other errors are raised."""
    import ctypes

    libc, machine = ctypes.CDLL(None, use_errno=True), os.uname().machine
    args = (dir_fd, os.fsencode(a), b_dir_fd, os.fsencode(b), _RENAME_EXCHANGE)
    if hasattr(libc, "renameat2"):
        result = libc.renameat2(*args)
    elif machine in _SYS_RENAMEAT2:
        result = libc.syscall(_SYS_RENAMEAT2[machine], *args)
    else:
        return False
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def publish_link(dir_fd: int, source_name: str, final_name: str, expected: tuple[int, int, int]) -> os.stat_result:
    """Publish `final_name` as a second name of the file `source_name` (same directory), which must
    still be `expected` = (inode, size, mtime_ns): hard-linked under the temp name, checked, fsynced,
    renamed into place, the directory fsynced. No byte is written again. Returns the published file's
    stat. FileExistsError if the source is not the expected file; OSError (EPERM, EXDEV, EMLINK) where
    the filesystem has no hard links: the caller copies instead."""
    name = _clear_temp(dir_fd, final_name)
    os.link(source_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            ino, size, mtime_ns = expected  # an inode of 0: not recorded, size and mtime decide
            if (
                (st.st_size, st.st_mtime_ns) != (size, mtime_ns)
                or ino not in (0, st.st_ino)
                or not stat.S_ISREG(st.st_mode)
            ):
                raise FileExistsError(f"{source_name} is no longer the copy that was recorded")
            os.fsync(fd)  # its inode (link count) is durable before the name is published
        finally:
            os.close(fd)
        os.replace(name, final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)
    return os.stat(final_name, dir_fd=dir_fd, follow_symlinks=False)


def _clear_temp(dir_fd: int, final_name: str) -> str:
    """The temp name of `final_name`, a stale file under it removed (see create_temp: whose it can be)."""
    name = temp_name(final_name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
    return name


def _still_ours(dir_fd: int, final_name: str, temp_fd: int) -> str:
    name = temp_name(final_name)
    ours = os.fstat(temp_fd)
    there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
        raise FileExistsError(f"{name} was replaced while it was being written")
    return name


def write_bytes_atomic(path: Path, data: bytes, overwrite: bool = True, mode: int = 0o644) -> None:
    """Publish a small file (the manifest, a starter config) with the full protocol."""
    with atomic_output(path, overwrite, mode) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], overwrite: bool = True, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a file open on PATH.part; publish it as PATH only if the block completes.

    On exit without error: flush, fsync, publish (publish_new with overwrite=False: never over an
    existing file), fsync the directory. On any exception the temp file is removed and the exception
    propagates; PATH is untouched.
    """
    final = Path(path)
    dir_fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = create_temp(dir_fd, final.name, mode)
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                yield f
                f.flush()
            os.fsync(fd)
            (publish if overwrite else publish_new)(dir_fd, final.name, fd)
        except BaseException:
            discard_temp(dir_fd, final.name, fd)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


# The primitives of folder units (mirrord.store.staging) and of the journal: every fsync, rename and
# removal of the package goes through this module, so durability is checked (and broken, by the chaos
# suite) in one place (tests/unit/test_layers.py holds every other module to it).


def sync(fd: int) -> None:
    """fsync a file or a folder."""
    os.fsync(fd)


def rename(src: str, dst: str, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """Rename `src` onto `dst` (the caller fsyncs both folders)."""
    os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)


def link(src: str, dst: str, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """Make `dst` a second name of the file `src`, in place of any file there (the caller fsyncs the folder)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dst, dir_fd=dst_dir_fd)
    os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=False)


def remove_empty_folder(dir_fd: int, name: str) -> None:
    """Remove a folder only if it is empty (OSError otherwise)."""
    os.rmdir(name, dir_fd=dir_fd)


def sync_tree(fd: int) -> None:
    """fsync a staged folder and every folder below it (files were fsynced as they were sealed)."""
    os.fsync(fd)
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            try:
                sync_tree(child)
            finally:
                os.close(child)


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove `name` below dir_fd and everything in it, never following a symlink; nothing if absent."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)  # by descriptors (never through a symlink swapped in meanwhile)
    else:
        os.unlink(name, dir_fd=dir_fd)
