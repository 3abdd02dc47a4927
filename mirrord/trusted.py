"""Reading a small file that steers the daemon (the config, the mirror's volume id) only when it can be trusted.

Trusted: a regular file that root or the daemon's own user owns, and that no one else can write (no
write bit for others; a group write bit only for root's group or the daemon's). Opened with O_NONBLOCK
(a FIFO swapped in never blocks the open) and, for metadata inside a folder others may write, with
O_NOFOLLOW (a symlink to /dev/zero is refused); read with a size bound. The config itself may be a
symlink (a Kubernetes ConfigMap is one): the file it names is judged.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedFileError(OSError):
    """The file is not one the daemon may trust; str() says why."""


def distrust(st: os.stat_result) -> str | None:
    """Why a file with this stat may not steer the daemon, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, neither root nor this daemon's user (uid {os.geteuid()})"
    if st.st_mode & stat.S_IWOTH:
        return f"can be written by any user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and st.st_gid not in (0, os.getegid()):
        return f"can be written by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read_trusted(path: Path | str, limit: int, *, follow: bool = False) -> tuple[os.stat_result, bytes]:
    """(its stat, its bytes: at most `limit`), or UntrustedFileError/OSError. `follow`: the last component
    may be a symlink (the operator's own choice of file, like the config)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        why = distrust(st)
        if why is not None:
            raise UntrustedFileError(f"{path} {why}: not trusted")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise UntrustedFileError(f"{path} is larger than {limit} bytes: not trusted")
        return st, data
    finally:
        os.close(fd)
