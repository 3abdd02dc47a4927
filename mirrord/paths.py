"""Path safety: every file mirrord touches is reached from a configured root, one component at a time,
never through a symlink. This is what `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` gives in C.
Also the names every layer agrees on (the temp suffix of an unpublished copy, what a safe relative path is,
where an object-store mirror lives) and whether two roots are one tree, on the ground floor so that the
config, the pure core, the store and the formats can all use them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mirrord.errors import UnsafePathError

TEMP_SUFFIX = ".part"  # NAME.part: a copy (or a folder unit) not yet whole; discovery ignores it
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_rel(rel: str) -> tuple[str, ...]:
    """Components of a root-relative POSIX path; UnsafePathError for absolute paths, '..', '.', empty
    parts and NUL bytes.

    Only the canonical form a listing produces is accepted ('a//b', './a', 'a/' are refused, not
    normalised): on an object store those are other keys than 'a/b' and 'a'.
    """
    parts = tuple(rel.split("/"))
    if "" in parts or "." in parts or ".." in parts:  # also '' itself and '/...' (an empty first part)
        raise UnsafePathError(repr(rel), "not a safe relative path")
    if "\0" in rel:
        raise UnsafePathError(repr(rel), "path contains NUL")
    return parts


def open_root(root: Path) -> int:
    """Open a configured root directory (the root itself may be a symlink: the operator chose it)."""
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir_beneath(root: Path, rel_dir: tuple[str, ...], create: bool = False, modes: tuple[int, ...] = ()) -> int:
    """Open root/rel_dir without following any symlink below root; optionally create missing parts,
    each with its mode in `modes` (the source's: see source_modes), else 0o755.

    Newly created directories are made durable by fsyncing their parent, so a published file is never
    reachable only through a directory entry that a power cut can lose.
    """
    fd = open_root(root)
    try:
        for i, part in enumerate(rel_dir):
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, modes[i] if i < len(modes) else 0o755, dir_fd=fd)
                os.fsync(fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def source_modes(source_root: Path | None, rel: str) -> tuple[int, ...]:
    """The permission bits of each component of source_root/rel, as far as they exist: what the mirror
    gives the folders and the file it creates for rel, so a private checkpoint (0700 folder, 0600 file)
    stays private there whatever the umask (which can only narrow them further)."""
    modes: list[int] = []
    if source_root is None:
        return ()
    with contextlib.suppress(OSError, UnsafePathError):
        parts = split_rel(rel)
        for i in range(len(parts)):
            st = lstat_beneath(source_root, "/".join(parts[: i + 1]))
            if st is None:
                break
            # The permission bits only (never setuid: a root daemon's copy would be root's), and the owner
            # (this daemon) can always write what it creates.
            modes.append(st.st_mode & 0o777 | (0o700 if stat.S_ISDIR(st.st_mode) else 0o600))
    return tuple(modes)


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
        os.set_blocking(fd, True)  # F_SETFL on the fd just opened: nothing to fail on
    return fd


@dataclass(frozen=True)
class S3Location:
    """Where an object-store mirror lives: the bucket and the key prefix."""

    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """`s3://bucket` or `s3://bucket/some/prefix`; ValueError (one readable line) otherwise."""
        if not url.startswith("s3://"):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url[5:].partition("/")
        if not bucket or "/" in bucket or len(bucket) < 3:
            raise ValueError(f"{url!r}: no valid bucket name after s3://")
        prefix = prefix.strip("/")
        if prefix:
            split_rel(prefix)  # no '..', no empty components, no NUL
        return cls(bucket, f"{prefix}/" if prefix else "")

    def key(self, rel: str) -> str:
        """The object key of `rel`."""
        return self.prefix + rel

    def url(self, rel: str = "") -> str:
        """The s3:// URL of `rel` (for messages)."""
        return f"s3://{self.bucket}/{self.prefix}{rel}"


# ------------------------------------------------------------------------------- roots by identity
def _key(path: Path) -> tuple[int, int] | None:
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    try:
        with open(mountinfo, encoding="utf-8") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [Path(fields[4].encode().decode("unicode_escape")) for fields in rows if len(fields) > 4]


def overlap(primary: Path, mirror: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Why PRIMARY and MIRROR are not two separate trees when compared by (device, inode), or None.

    Catches what resolving paths cannot: the same directory under two names through a bind mount, a
    mirror whose path runs through a bind mount of the primary (or the reverse), and a bind mount of
    one root placed somewhere below the other.
    """
    pkey, mkey = _key(primary), _key(mirror)
    if pkey is None:
        return None  # a missing primary is reported by the path checks
    if pkey == mkey:
        return f"{mirror} is the same directory as primary {primary} (same device and inode: a bind mount?)"
    name = {pkey: f"primary {primary}", mkey: str(mirror)}
    # The mirror's parents are compared even for a mirror not created yet (mkey None).
    pairs = ((mirror, mkey, pkey), (primary, pkey, mkey))
    for path, key, other in pairs:
        for parent in Path(path).resolve().parents:
            if other is not None and _key(parent) == other:
                return f"{name[key]} is inside {name[other]} (reached through {parent}: a bind mount?)"
    if mkey is None:
        return None
    points = _mount_points(mountinfo)
    for path, key, other in pairs:  # a mount point strictly below one root whose directory is the other
        below = path.resolve()
        for point in points:
            if point != below and point.is_relative_to(below) and _key(point) == other:
                return f"{name[other]} is mounted inside {name[key]} at {point} (a bind mount)"
    return None
