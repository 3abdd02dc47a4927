"""A FUSE passthrough for the chaos tests and the copy gate (mfusepy over libfuse): files are read-only,
but may be deleted (a trainer's rotation, or mirrord's retention on the primary).

    python passthrough.py BACKING MOUNTPOINT STALLFILE

Serves BACKING at MOUNTPOINT. Changes made directly in BACKING reach readers of the mount, but no
inotify event is ever raised on the mount: the situation of NFS, SMB or a 9p bridge, where only
polling or a rescan sees new files. While STALLFILE exists, reads of any file whose name is listed
in it block (from the byte offset after the name, if one is given; `*` names every file): a hung
network mount, as seen by a copy in progress. Only the stream is held: the reads of the thread that read
an open file first. Reads of the same file by another thread go through: the copier's validator reads a
zip's directory and record headers from its write thread while the copy thread streams (held there, it
would hold the copy at its second buffer, wherever the gate is).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mfusepy

STALL_LIMIT_SECONDS = 300  # a stalled read never blocks longer than this, whatever the test does


class Passthrough(mfusepy.Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(self, backing: str, stall_file: str) -> None:
        self.backing = backing
        self.stall_file = stall_file
        self._streams: dict[int, int] = {}  # per open file: the thread (its id as FUSE gives it) that read it first
        self._lock = threading.Lock()

    def _full(self, path: str) -> str:
        return str(Path(self.backing) / path.lstrip("/"))

    def _stalled(self, path: str, offset: int) -> bool:
        """Whether STALLFILE holds this read: a line `NAME` or `NAME FROM` (reads from byte FROM on); `*` is
        any name."""
        try:
            with open(self.stall_file, encoding="utf-8") as f:
                lines = [line.split() for line in f.read().splitlines() if line.strip()]
        except FileNotFoundError:
            return False
        name = Path(path).name
        return any(words[0] in (name, "*") and offset >= (int(words[1]) if len(words) > 1 else 0) for words in lines)

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._full(path))
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno or errno.EIO) from exc
        # st_blocks as the backing file has them: without them the copier would take every file as sparse
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks")
        attrs: dict[str, Any] = {k: getattr(st, k) for k in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *(p.name for p in Path(self._full(path)).iterdir())]

    def readlink(self, path: str) -> str:
        return str(Path(self._full(path)).readlink())

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        return os.open(self._full(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        deadline = time.monotonic() + STALL_LIMIT_SECONDS
        reader = mfusepy.fuse_get_context()[2]  # the reading thread's id
        with self._lock:
            stream = self._streams.setdefault(fh, reader) == reader
        while stream and self._stalled(path, offset) and time.monotonic() < deadline:
            time.sleep(0.05)
        return os.pread(fh, size, offset)

    def unlink(self, path: str) -> None:
        Path(self._full(path)).unlink()

    def rmdir(self, path: str) -> None:
        Path(self._full(path)).rmdir()

    def release(self, path: str, fh: int) -> int:
        with self._lock:
            self._streams.pop(fh, None)
        os.close(fh)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._full(path))
        keys = (
            "f_bavail",
            "f_bfree",
            "f_blocks",
            "f_bsize",
            "f_favail",
            "f_ffree",
            "f_files",
            "f_flag",
            "f_frsize",
            "f_namemax",
        )
        return {k: getattr(st, k) for k in keys}


def main() -> None:
    backing, mount_point, stall_file = sys.argv[1:4]
    mfusepy.FUSE(Passthrough(backing, stall_file), mount_point, foreground=True, fsname="chaos-passthrough")


if __name__ == "__main__":
    main()
