"""Publishing a folder unit on a local mirror as a whole, and removing one.

    .mirrord-staging/TOKEN.part/ (created empty, fsynced) -> each file through LocalUpload (its own temp
    name, fsync, replace, fsync of the staging folder) -> fsync the staged tree -> rename onto NAME ->
    fsync NAME's parent and the staging area

The staging area is a hidden folder at the mirror root, on the same volume (so the rename is one step):
nothing half-made ever sits in a run folder, where a trainer's own checkpoint picker (accelerate's
highest number, HF's `checkpoint-N`) would take it for a step. A unit published again (the trainer
re-saved it with other bytes) is staged -> swapped -> deleted: the new folder and the old NAME/ exchange
names in one step (renameat2 RENAME_EXCHANGE across the two folders), both folders are fsynced, then the
old copy, now in the staging area, is removed if it is still the folder that was swapped out. Where
names cannot be exchanged, the old copy is first renamed into the staging area (the only instant without
NAME/). A reader sees no NAME/ or a whole unit, never a part of one, and never a mix. What a dead writer
left in the staging area is removed when the same unit is staged again, or when the mirror is locked
(sweep_staging_area: under the lock nothing else stages). Removal walks by descriptor and never follows
a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from mirrord.core.model import FileState
from mirrord.errors import from_oserror
from mirrord.paths import DIR_FLAGS, open_dir_beneath, source_modes, split_rel
from mirrord.store import atomic
from mirrord.store.upload import LocalUpload


def staging_token(key: str) -> str:
    """The name a unit is staged under in the staging area: unique per unit key, short, readable."""
    name = split_rel(key)[-1]
    return f"{hashlib.sha256(key.encode()).hexdigest()[:16]}-{name[:100]}{atomic.TEMP_SUFFIX}"


@contextlib.contextmanager
def dir_beneath(root: Path, parts: tuple[str, ...], create: bool = False) -> Iterator[int]:
    """root/parts opened beneath the root (mirrord.paths.open_dir_beneath), closed on leaving."""
    fd = open_dir_beneath(root, parts, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, int]:
    """A folder's (device, inode): whether a name still leads to the folder it led to."""
    return st.st_dev, st.st_ino


class FolderStaging:
    """One folder unit being staged in `root`'s staging area (see the module docstring)."""

    # commit() replaces an older copy under the key itself, whole, in one step (see the module docstring).
    replaces = True

    def __init__(self, root: Path, key: str, modes_from: Path | None = None) -> None:
        parts = split_rel(key)
        self.root, self.key, self.modes_from = Path(root), key, modes_from
        self._parent, self._name, self._staging = parts[:-1], parts[-1], staging_token(key)
        self._done = False
        modes = source_modes(modes_from, key)
        os.close(open_dir_beneath(self.root, self._parent, create=True, modes=modes))  # commit() renames into it
        with dir_beneath(self.root, (atomic.STAGING_AREA,), create=True) as area_fd:
            atomic.remove_tree(area_fd, self._staging)  # a dead writer's staging of the same unit
            os.mkdir(self._staging, modes[-1] if len(modes) == len(parts) else 0o755, dir_fd=area_fd)
            # Held open until commit or abort: the inode cannot be reused by a later staging folder of
            # the same unit (ext4 reuses a freed inode at once), which the identity checks would take
            # for ours.
            self._fd = os.open(self._staging, DIR_FLAGS, dir_fd=area_fd)
            self._identity = _identity(os.fstat(self._fd))
            atomic.sync(area_fd)

    @property
    def staging_key(self) -> str:
        """The staging folder's key relative to the mirror root."""
        return f"{atomic.STAGING_AREA}/{self._staging}"

    def upload(self, relkey: str, size: int, drop_cache: bool = False) -> LocalUpload:
        """Begin one file of the unit (`relkey` relative to the unit): written into the staging folder."""
        member = split_rel(relkey)
        if self._done:
            raise RuntimeError("upload() after commit() or abort()")
        # The source's modes from the unit folder down, shifted onto the staging path (area, token, member).
        modes = source_modes(self.modes_from, f"{self.key}/{relkey}")
        whole = len(modes) == len(self._parent) + 1 + len(member)
        return LocalUpload(
            self.root,
            f"{self.staging_key}/{relkey}",
            size,
            drop_cache,
            (0o700, *modes[len(self._parent) :]) if whole else (),
        )

    def commit(self) -> None:
        """fsync the staged tree, then publish it as NAME: renamed there, or exchanged with an older
        copy of the unit (which is then removed); fsync both folders. FileExistsError if NAME is not a
        folder or the staging folder was replaced meanwhile."""
        if self._done:
            raise RuntimeError("commit() after commit() or abort()")
        with dir_beneath(self.root, (atomic.STAGING_AREA,)) as area_fd, dir_beneath(self.root, self._parent) as dir_fd:
            if _identity(os.stat(self._staging, dir_fd=area_fd, follow_symlinks=False)) != self._identity:
                raise FileExistsError(f"{self.root / self.staging_key} was replaced while staging")
            atomic.sync_tree(self._fd)
            try:
                old = os.stat(self._name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and not stat.S_ISDIR(old.st_mode):
                raise FileExistsError(errno.EEXIST, f"{self.root / self.key} exists and is not a folder")
            aside = self._swap(area_fd, dir_fd) if old is not None else None
            if aside is None:
                atomic.rename(self._staging, self._name, src_dir_fd=area_fd, dst_dir_fd=dir_fd)
            atomic.sync(dir_fd)
            atomic.sync(area_fd)
            self._done = True
            os.close(self._fd)
            if aside is not None and old is not None:
                # The old copy, whole until now, in the staging area: removed if it is still the folder
                # that was swapped out (else a later staging took the name); left to the sweep on failure.
                with contextlib.suppress(OSError):
                    if _identity(os.stat(aside, dir_fd=area_fd, follow_symlinks=False)) == _identity(old):
                        atomic.remove_tree(area_fd, aside)
                        atomic.sync(area_fd)

    def _swap(self, area_fd: int, dir_fd: int) -> str:
        """Put the staged folder under NAME in place of the old copy; returns the old copy's name in the
        staging area."""
        if atomic.exchange(area_fd, self._staging, self._name, dir_fd):
            return self._staging
        aside = self._staging.removesuffix(atomic.TEMP_SUFFIX) + atomic.ASIDE_SUFFIX
        atomic.remove_tree(area_fd, aside)  # a dead process's (the mirror lock is ours)
        atomic.rename(self._name, aside, src_dir_fd=dir_fd, dst_dir_fd=area_fd)
        atomic.rename(self._staging, self._name, src_dir_fd=area_fd, dst_dir_fd=dir_fd)
        return aside

    def abort(self) -> None:
        """Remove what was staged; never raises (it must not mask the error that caused it)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError), dir_beneath(self.root, (atomic.STAGING_AREA,)) as area_fd:
            if _identity(os.stat(self._staging, dir_fd=area_fd, follow_symlinks=False)) == self._identity:
                atomic.remove_tree(area_fd, self._staging)  # not a later staging of the same unit
                atomic.sync(area_fd)
        os.close(self._fd)


def retire_folder(root: Path, key: str) -> None:
    """Retire the published folder `key` whole: renamed into the staging area in one step (a reader
    sees the whole unit or none), both folders fsynced, then removed there. Nothing if it is gone."""
    parts = split_rel(key)
    aside = staging_token(key).removesuffix(atomic.TEMP_SUFFIX) + ".retired"
    with dir_beneath(root, (atomic.STAGING_AREA,), create=True) as area_fd, dir_beneath(root, parts[:-1]) as dir_fd:
        atomic.remove_tree(area_fd, aside)  # a dead retirement of the same unit
        try:
            atomic.rename(parts[-1], aside, src_dir_fd=dir_fd, dst_dir_fd=area_fd)
        except FileNotFoundError:
            return
        atomic.sync(dir_fd)
        atomic.sync(area_fd)
        atomic.remove_tree(area_fd, aside)
        atomic.sync(area_fd)


def sweep_staging_area(root: Path) -> int:
    """Remove what dead writers left in the staging area (call with the mirror's lock held: then no
    one else is staging); returns how many entries were removed. Never raises for a missing area."""
    try:
        with dir_beneath(root, (atomic.STAGING_AREA,)) as area_fd:
            names = os.listdir(area_fd)  # noqa: PTH208 - by descriptor
            for name in names:
                atomic.remove_tree(area_fd, name)
            if names:
                atomic.sync(area_fd)
            return len(names)
    except FileNotFoundError:
        return 0


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
            atomic.remove_empty_folder(dir_fd, parts[-1])
        else:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or (st.st_ino, st.st_dev) != (expected.ino, expected.dev):
                return False
            atomic.remove_tree(dir_fd, parts[-1])
        atomic.sync(dir_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            return False
        raise from_oserror(root / key, exc, "remove folder") from exc
    finally:
        os.close(dir_fd)
    return True


def list_folder(
    root: Path, key: str, wanted: Callable[[str], bool], not_files: list[str] | None = None
) -> dict[str, tuple[int, int, int, int]]:
    """Every regular file below root/key whose name `wanted` accepts (hidden folders not entered, no
    symlink followed), as rel -> (ino, size, mtime_ns, ctime_ns). FileNotFoundError if it is gone.
    `not_files` receives the wanted names that are neither a folder nor a regular file (a symlink, a
    FIFO, a socket): members that cannot be copied as files."""
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
                    elif not stat.S_ISDIR(st.st_mode) and wanted(name) and not_files is not None:
                        not_files.append(rel)
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return found
