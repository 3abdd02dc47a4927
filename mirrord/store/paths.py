"""Path safety: every file mirrord touches is reached from a configured root, one component at a time,
never through a symlink. This is what `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` gives in C.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mirrord.names import split_rel as split_rel  # (re-exported: the store's users name it here)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_root(root: Path) -> int:
    """Open a configured root directory (the root itself may be a symlink: the operator chose it)."""
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir_beneath(root: Path, rel_dir: tuple[str, ...], create: bool = False) -> int:
    """Open root/rel_dir without following any symlink below root; optionally create missing parts.

    Newly created directories are made durable by fsyncing their parent, so a published file is never
    reachable only through a directory entry that a power cut can lose.
    """
    fd = open_root(root)
    try:
        for part in rel_dir:
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                os.fsync(fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_beneath(root: Path, rel: str) -> os.stat_result | None:
    """lstat of root/rel, reached one component at a time without following a symlink; None when it or
    a folder on the way is not there. Other errors (EACCES, EIO, ELOOP...) are raised: they are not "gone"."""
    parts = split_rel(rel)
    try:
        dir_fd = open_dir_beneath(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)


def open_file_beneath(root: Path, rel: str, flags: int = os.O_RDONLY) -> int:
    """Open root/rel for reading with no symlink anywhere below root (ELOOP/ENOTDIR if one is met).

    The open itself never blocks: a FIFO swapped in for a checkpoint would otherwise wait forever for
    a writer. Callers check S_ISREG on the result; a regular file is returned in blocking mode.
    """
    parts = split_rel(rel)
    dir_fd = open_dir_beneath(root, parts[:-1])
    try:
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    if not flags & os.O_NONBLOCK:
        try:
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
    return fd
