"""Publishing a folder unit on a local mirror as a whole, and removing one.

    NAME.part/ (created empty, parent fsynced) -> each file through LocalUpload (its own temp name,
    fsync, replace, fsync of the staging folder) -> fsync NAME.part/ -> rename onto NAME -> fsync parent

A unit published again (the trainer re-saved it with other bytes) is staged -> swapped -> deleted: the
whole new NAME.part/ and the old NAME/ exchange names in one step (renameat2 RENAME_EXCHANGE), the
parent is fsynced, then the old copy, now NAME.part/, is removed if it is still the folder that was
swapped out. Where names cannot be exchanged, the old copy is renamed aside to NAME.old.part/ and the
new one renamed onto NAME (the only instant without NAME/). A reader sees no NAME/ or a whole unit,
never a part of one, and never a mix. A NAME.part/ or NAME.old.part/ left by a dead writer is removed
when the same unit is staged again, or swept by retention once old enough. Removal walks by
descriptor and never follows a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mirrord.core.model import FileState
from mirrord.errors import from_oserror
from mirrord.paths import DIR_FLAGS, open_dir_beneath, split_rel
from mirrord.store import atomic

if TYPE_CHECKING:
    from mirrord.store.volume import LocalUpload


class FolderStaging:
    """One folder unit being staged beneath `root` (see the module docstring)."""

    def __init__(self, root: Path, key: str) -> None:
        parts = split_rel(key)
        self.root = Path(root)
        self.key = key
        self._parent = parts[:-1]
        self._name = parts[-1]
        self._staging = atomic.temp_name(self._name)
        self._done = False
        dir_fd = open_dir_beneath(self.root, self._parent, create=True)
        try:
            remove_tree(dir_fd, self._staging)
            os.mkdir(self._staging, 0o755, dir_fd=dir_fd)
            # Held open until commit or abort: the inode cannot be reused by a later staging folder of
            # the same unit (ext4 reuses a freed inode at once), which the identity checks would take
            # for ours.
            self._fd = os.open(self._staging, DIR_FLAGS, dir_fd=dir_fd)
            st = os.fstat(self._fd)
            self._identity = (st.st_dev, st.st_ino)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @property
    def staging_key(self) -> str:
        """The staging folder's key relative to the mirror root."""
        return "/".join((*self._parent, self._staging))

    def upload(self, relkey: str, size: int, drop_cache: bool = False) -> LocalUpload:
        """Begin one file of the unit (`relkey` relative to the unit): written into the staging folder."""
        from mirrord.store.volume import LocalUpload  # the file protocol lives with the volume

        split_rel(relkey)
        if self._done:
            raise RuntimeError("upload() after commit() or abort()")
        return LocalUpload(self.root, f"{self.staging_key}/{relkey}", size, drop_cache)

    # commit() replaces an older copy under the key itself, whole, in one step (see the module docstring).
    replaces = True

    def commit(self) -> None:
        """fsync the staging folder, then publish it as NAME: renamed there, or exchanged with an older
        copy of the unit (which is then removed); fsync the parent. FileExistsError if NAME is not a
        folder or the staging folder was replaced meanwhile."""
        if self._done:
            raise RuntimeError("commit() after commit() or abort()")
        dir_fd = open_dir_beneath(self.root, self._parent)
        try:
            staged = os.open(self._staging, DIR_FLAGS, dir_fd=dir_fd)
            try:
                st = os.fstat(staged)
                if (st.st_dev, st.st_ino) != self._identity:
                    raise FileExistsError(f"{self.root / self.staging_key} was replaced while staging")
                _fsync_tree(staged)
            finally:
                os.close(staged)
            try:
                old = os.stat(self._name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and not stat.S_ISDIR(old.st_mode):
                raise FileExistsError(errno.EEXIST, f"{self.root / self.key} exists and is not a folder")
            if old is None:
                os.rename(self._staging, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.fsync(dir_fd)
                aside = None
            else:
                aside = self._swap(dir_fd)
            self._done = True
            self._close()
            if aside is not None:
                # The old copy, whole until now, under a temp name: removed if it is still the folder that
                # was swapped out (else a later staging took the name); left to the sweep on failure.
                with contextlib.suppress(OSError):
                    there = os.stat(aside, dir_fd=dir_fd, follow_symlinks=False)
                    if old is not None and (there.st_dev, there.st_ino) == (old.st_dev, old.st_ino):
                        remove_tree(dir_fd, aside)
                        os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _swap(self, dir_fd: int) -> str:
        """Put the staged folder under NAME in place of the old copy; returns where the old copy is now."""
        if atomic.exchange(dir_fd, self._staging, self._name):
            os.fsync(dir_fd)
            return self._staging
        aside = self._name + atomic.ASIDE_SUFFIX
        remove_tree(dir_fd, aside)  # a dead process's (the mirror lock is ours)
        os.rename(self._name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.rename(self._staging, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
        return aside

    def abort(self) -> None:
        """Remove what was staged; never raises (it must not mask the error that caused it)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            dir_fd = open_dir_beneath(self.root, self._parent)
            try:
                st = os.stat(self._staging, dir_fd=dir_fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == self._identity:  # a later staging of the same unit is not ours
                    remove_tree(dir_fd, self._staging)
                    os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fsync_tree(fd: int) -> None:
    """fsync a staged folder and every folder below it (files were fsynced as they were sealed)."""
    os.fsync(fd)
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            try:
                _fsync_tree(child)
            finally:
                os.close(child)


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove `name` below dir_fd and everything in it, never following a symlink; nothing if absent."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):  # noqa: PTH208 - by descriptor: no path to swap under us
            remove_tree(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_folder(root: Path, key: str, expected: FileState | None = None) -> bool:
    """Remove the folder `key` and what is in it (a dead staging folder, whose `expected` identity must
    still hold), or, with expected None, only if it is empty (a unit whose files were deleted one by one).
    Returns False when it was left: not empty, or no longer the folder that was planned."""
    parts = split_rel(key)
    try:
        dir_fd = open_dir_beneath(root, parts[:-1])
    except FileNotFoundError:
        return True
    except OSError as exc:
        raise from_oserror(root / key, exc, "open parent directory") from exc
    try:
        if expected is None:
            os.rmdir(parts[-1], dir_fd=dir_fd)
        else:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or (st.st_ino, st.st_dev) != (expected.ino, expected.dev):
                return False
            remove_tree(dir_fd, parts[-1])
        os.fsync(dir_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            return False
        raise from_oserror(root / key, exc, "remove folder") from exc
    finally:
        os.close(dir_fd)
    return True


def list_folder(root: Path, key: str, wanted: Callable[[str], bool]) -> dict[str, tuple[int, int, int, int]]:
    """Every regular file below root/key whose name `wanted` accepts (hidden folders not entered, no
    symlink followed), as rel -> (ino, size, mtime_ns, ctime_ns). FileNotFoundError if it is gone."""
    found: dict[str, tuple[int, int, int, int]] = {}
    top = open_dir_beneath(root, split_rel(key))
    stack = [(top, key)]
    try:
        while stack:
            fd, rel_dir = stack.pop()
            try:
                for name in os.listdir(fd):  # noqa: PTH208 - by descriptor
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    rel = f"{rel_dir}/{name}"
                    if stat.S_ISDIR(st.st_mode) and not name.startswith("."):
                        stack.append((os.open(name, DIR_FLAGS, dir_fd=fd), rel))
                    elif stat.S_ISREG(st.st_mode) and wanted(name):
                        found[rel] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return found
