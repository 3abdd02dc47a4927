"""The imperative shell around one directory tree: list, stat, read, delete, and (for the mirror) publish.

`LocalVolume` is a tree read beneath its root (the primary, or any side for read-only commands);
`LocalMirror` is the filesystem implementation of the storage seam, mirrord.store.mirror.Mirror
(local disk, NFS, SMB, FUSE bridges). Keys are root-relative POSIX paths; `Path` stays in here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, BinaryIO

from mirrord.core.model import VERSIONS, FileState, ManifestEntry, Snapshot
from mirrord.errors import (
    ChangedError,
    LockedError,
    ManifestError,
    UnsafePathError,
    from_oserror,
)
from mirrord.layouts import Layout
from mirrord.paths import lstat_beneath, open_dir_beneath, open_file_beneath, source_modes, split_rel
from mirrord.store import atomic
from mirrord.store.manifest import MANIFEST_NAME, Manifest
from mirrord.store.mirror import Mirror, ReadableStore
from mirrord.store.scan import snapshot_tree, snapshot_unit, state_from_stat, unit_folders
from mirrord.store.staging import FolderStaging, dir_beneath, remove_folder, retire_folder, sweep_staging_area
from mirrord.store.upload import LocalUpload

if TYPE_CHECKING:
    from mirrord.store.identity import VolumeIdentity

# Pinning a locked mirror (mirrord.store.identity) is imported where it is used: a read-only command
# (`mirrord latest`) does not.

LOCK_NAME = ".mirrord.lock"
NO_HARD_LINK = (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.ENOSYS)  # link(2) cannot be had here


class LocalVolume:
    """A directory tree reached only beneath its root, never through a symlink."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.exclude: frozenset[tuple[int, int]] = frozenset()  # (dev, ino) of the other root: never entered

    def describe(self, key: str = "") -> str:
        """The path of the root, or of `key` below it, for messages."""
        return str(self.root / key) if key else str(self.root)

    def local_tree(self) -> LocalVolume:
        """This very tree."""
        return self

    def exists(self) -> bool:
        """Whether the root is a directory."""
        return self.root.is_dir()

    def snapshot(self, patterns: Iterable[str], layout: Layout | None = None) -> Snapshot:
        """List the candidate files beneath the root (never following a link, never entering an excluded root)."""
        return snapshot_tree(self.root, patterns, collect_partials=True, exclude=self.exclude, layout=layout)

    def snapshot_unit(self, rel: str, layout: Layout) -> Snapshot:
        """List one unit folder beneath the root (mirrord.store.scan.snapshot_unit)."""
        return snapshot_unit(self.root, rel, layout)

    def unit_folders(self, run: str, layout: Layout) -> list[str]:
        """The unit folders directly in the run folder `run` (mirrord.store.scan.unit_folders)."""
        return unit_folders(self.root, run, layout)

    def key(self) -> tuple[int, int]:
        """(device, inode) of the root directory."""
        st = self.root.stat()
        return st.st_dev, st.st_ino

    def stat(self, rel: str) -> FileState | None:
        """lstat of `rel` beneath the root (None if it is not there), never through a symlink."""
        st = lstat_beneath(self.root, rel)
        return None if st is None else state_from_stat(rel, st)

    def open_read(self, rel: str) -> BinaryIO:
        """The regular file at rel, opened beneath the root without following a symlink and without
        blocking on a FIFO; OSError (EINVAL) for anything that is not a regular file."""
        fd = open_file_beneath(self.root, rel)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def load_manifest(self) -> Manifest:
        """The manifest in this tree, read-only (empty where there is none: a primary)."""
        return Manifest.load(self.root)

    def delete(self, rel: str, expected: FileState) -> None:
        """Unlink rel only if it is still the regular file that was planned (same inode, size, mtime).

        The check and the unlink use the same directory fd, so a directory swapped for a symlink
        between planning and deleting cannot redirect the unlink outside the root.
        """
        parts = split_rel(rel)
        try:
            dir_fd = open_dir_beneath(self.root, parts[:-1])
        except OSError as exc:
            raise from_oserror(self.describe(rel), exc, "open parent directory") from exc
        try:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise ChangedError(self.describe(rel), "no longer a regular file")
            if (st.st_ino, st.st_size, st.st_mtime_ns) != (expected.ino, expected.size, expected.mtime_ns):
                raise ChangedError(self.describe(rel), "changed since it was planned for deletion")
            atomic.unlink_durably(dir_fd, parts[-1])
        except FileNotFoundError:
            return
        except OSError as exc:
            raise from_oserror(self.describe(rel), exc, "delete") from exc
        finally:
            os.close(dir_fd)

    def space(self) -> tuple[int, int]:
        """(free bytes available to us, total bytes) of the filesystem holding the root."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def stat_safely(store: ReadableStore, rel: str) -> FileState | None:
    """The state of `rel`, or None when it is gone or cannot be reached safely."""
    try:
        return store.stat(rel)
    except (OSError, UnsafePathError):
        return None


def guard_roots(primary: LocalVolume, mirror: Mirror) -> dict[str, PurePath] | None:
    """The roots for the prune guard that keeps deletions inside their own tree and out of the other
    (a mirror nested in the primary); None when the mirror is not a directory tree (nothing to nest)."""
    tree = mirror.local_tree()
    if tree is None:
        return None
    return {"primary": PurePath(primary.root.resolve()), "mirror": PurePath(tree.root.resolve())}


def exclude_each_other(primary: LocalVolume, mirror: ReadableStore) -> None:
    """Neither listing enters the other root (reached through a bind mount); only trees can meet, and a
    root that cannot be stat'ed now is left to the listing to report."""
    tree = mirror.local_tree()
    if tree is not None:
        with contextlib.suppress(OSError):
            primary.exclude = frozenset({tree.key()})
            tree.exclude = frozenset({primary.key()})


class LocalMirror(LocalVolume):
    """The filesystem implementation of Mirror.

    While the lock is held the mirror is pinned (mirrord.store.identity): every upload, manifest write and
    deletion first checks that the root is still the volume the lock was taken on.
    """

    has_inodes = True
    node = ""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.modes_from: Path | None = None  # the primary root: new folders and files keep its modes
        self.identity: VolumeIdentity | None = None
        self._lock_fd = -1

    def keep_modes_of(self, primary: Path) -> None:
        """New folders and files keep the primary's modes (mirrord.paths.source_modes)."""
        self.modes_from = primary

    def check_identity(self) -> None:
        """Raise MirrorGoneError if the mirror is no longer the pinned volume (no-op when not pinned)."""
        if self.identity is not None:
            self.identity.check()

    def identity_problem(self) -> str | None:
        """check_identity as a sentence, or None while all is well."""
        return None if self.identity is None else self.identity.problem()

    def begin_upload(self, rel: str, size: int, drop_cache: bool = False) -> LocalUpload:
        """Begin writing `rel` under its temp name (the mirror must still be the pinned volume); a version
        (version_key) in a folder only the daemon's user reads (0700)."""
        self.check_identity()
        kept = rel.removeprefix(VERSIONS + "/")
        modes = source_modes(self.modes_from, kept)
        return LocalUpload(self.root, rel, size, drop_cache, modes if kept == rel else (0o700, *modes))

    def snapshot(self, patterns: Iterable[str], layout: Layout | None = None) -> Snapshot:
        """The candidate files (LocalVolume.snapshot) and, apart, the versions kept beside them (VERSIONS)."""
        listed = super().snapshot(patterns, layout)
        kept = snapshot_tree(self.root, ("*",), unit=VERSIONS)  # (none there: nothing, silently)
        return dataclasses.replace(listed, versions=kept.files, errors=listed.errors + kept.errors)

    def rename(self, key: str, other: str, keep: bool = False) -> bool:
        """Rename `key` onto `other` (a version promoted over the copy there) or, with `keep`, give it the second
        name `other` (a hard link: no byte written again); both folders fsynced. False where the filesystem
        has no hard links (nothing done)."""
        self.check_identity()
        src, dst = split_rel(key), split_rel(other)
        try:
            with dir_beneath(self.root, src[:-1]) as src_fd, dir_beneath(self.root, dst[:-1]) as dst_fd:
                (atomic.link if keep else atomic.rename)(src[-1], dst[-1], src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                atomic.sync(dst_fd)
                atomic.sync(src_fd)
        except OSError as exc:
            if keep and exc.errno in NO_HARD_LINK:
                return False
            raise from_oserror(self.describe(other), exc, f"rename {self.describe(key)} to") from exc
        return True

    def set_manifest_aside(self, suffix: str) -> list[str]:
        """Rename the manifest snapshot and journals to NAME+suffix (never deleted: a person may want them)."""
        journals = sorted(self.root.glob(MANIFEST_NAME.removesuffix(".json") + ".journal.*"))
        moved = []
        for path in [self.root / MANIFEST_NAME, *journals]:
            if path.name.endswith(suffix) or not (path.exists() or path.is_symlink()):
                continue
            aside = path.with_name(path.name + suffix)
            try:
                path.replace(aside)
            except OSError as exc:
                raise ManifestError(path, f"cannot move the old manifest aside: {exc.strerror or exc}") from exc
            moved.append(aside.name)
        if moved:
            atomic.fsync_dir(self.root)
        return moved

    def link_aliases(
        self, primary_root: Path, links: list[str], entries: Mapping[str, ManifestEntry]
    ) -> list[tuple[str, str]]:
        """Mirror.link_aliases: the links made beside the copies (mirrord.store.aliases)."""
        from mirrord.store.aliases import mirror_alias_links

        return mirror_alias_links(primary_root, self.root, links, entries) if links else []

    def is_mountpoint(self) -> bool:
        """Whether the mirror root is a mount point."""
        return self.root.is_mount()

    def delete(self, rel: str, expected: FileState) -> None:
        """Delete `rel` if it is still `expected` (the mirror must still be the pinned volume)."""
        self.check_identity()
        super().delete(rel, expected)

    def clone(self, source_key: str, key: str, expected: FileState) -> FileState | None:
        """Publish `key` with the bytes of `source_key` (still `expected`: inode, size, mtime) without
        writing them again: a hard link in the same folder, through atomic.publish_link. None where that
        cannot be (another folder, no hard links on this filesystem, the source changed): copy instead."""
        self.check_identity()
        src, dst = split_rel(source_key), split_rel(key)
        if src[:-1] != dst[:-1]:
            return None
        try:
            dir_fd = open_dir_beneath(self.root, dst[:-1])
        except OSError as exc:
            raise from_oserror(self.describe(key), exc, "open parent directory") from exc
        try:
            st = atomic.publish_link(dir_fd, src[-1], dst[-1], (expected.ino, expected.size, expected.mtime_ns))
        except (FileExistsError, FileNotFoundError):
            return None  # the recorded copy is not there as recorded: not a twin any more
        except OSError as exc:
            if exc.errno in NO_HARD_LINK:
                return None
            raise from_oserror(self.describe(key), exc, "link") from exc
        finally:
            os.close(dir_fd)
        return state_from_stat(key, st)

    def begin_unit(self, key: str) -> FolderStaging:
        """Start publishing the folder unit `key` as a whole (mirrord.store.staging)."""
        self.check_identity()
        return FolderStaging(self.root, key, self.modes_from)

    def claim_retention(self) -> None:
        """One node prunes a local mirror: this one."""

    def require_retention(self) -> None:
        """Nothing to hold."""

    def sweep_stale_uploads(self, older_than: float) -> int:
        """No uploads outlive a local writer (its .part is swept by the listing)."""
        return 0

    def delete_unit(self, key: str, files: Iterable[tuple[str, FileState]] = ()) -> None:
        """Retire a folder unit whole (mirrord.store.staging.retire_folder). The caller re-checked every
        file and dropped the manifest entries first."""
        self.check_identity()
        try:
            retire_folder(self.root, key)
        except OSError as exc:
            raise from_oserror(self.root / key, exc, "delete folder unit") from exc

    def delete_folder(self, key: str, expected: FileState | None = None) -> bool:
        """Remove a dead staging folder (still `expected`) with what is in it, or (expected None) an
        emptied unit folder; False when it was left (not empty, or not the planned folder)."""
        self.check_identity()
        return remove_folder(self.root, key, expected)

    def read_manifest(self) -> Manifest:
        """The manifest, open for changes: each one is journaled and fsynced on this mirror (mirrord.store.journal);
        every write first checks that the mirror is still the pinned volume."""
        return Manifest.open(self.root, guard=self.check_identity)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One mirrord per mirror: the lock is what makes a leftover NAME.part safe to replace.

        The lock file is held open read-only (flock needs no write access), so holding it does not
        keep the mirror busy for `mount -o remount,ro`. While it is held the mirror is pinned
        (see check_identity) and `lock_problem()` tells whether the file is still the one locked.
        """
        created = [p for p in (self.root, *self.root.parents) if not p.exists()]
        self.root.mkdir(parents=True, exist_ok=True)
        for path in reversed(created):  # a root that a power cut can unlink loses every file below it
            atomic.fsync_dir(path.parent)
        self._lock_fd = self._acquire_lock()
        from mirrord.store.identity import VolumeIdentity

        try:
            self.identity = VolumeIdentity.establish(self.root)
            with contextlib.suppress(OSError):  # leftovers only cost space; the next lock tries again
                sweep_staging_area(self.root)
            yield
        finally:
            self.identity = None
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _acquire_lock(self) -> int:
        path = self.root / LOCK_NAME
        for _ in range(20):
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _lock_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise LockedError(self.root, f"another mirrord process{holder} is using this mirror") from exc
                raise
            if _same_inode(fd, path):
                break
            # Unlinked or replaced between our open and our flock: lock the file at the path now.
            os.close(fd)
        else:
            raise LockedError(path, "the lock file keeps being replaced; another process is fighting over it")
        with contextlib.suppress(OSError):  # the pid is for people; the flock is the lock
            pid_fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.write(pid_fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(pid_fd)
        return fd

    def write_problem(self) -> str | None:
        """Always None: a flock holds as long as this process lives (lock_problem tells if it was lost)."""
        return None

    def lock_problem(self) -> str | None:
        """None while the file at .mirrord.lock is the one we locked; else why the lock is lost.

        The same volume mounted again (on another device number) holds the same lock file on a new
        mount: that lock is taken over (flock again) rather than reported, unless someone holds it.
        """
        if self._lock_fd < 0:
            return None
        path = self.root / LOCK_NAME
        try:
            if _same_inode(self._lock_fd, path):
                return None
            there = path.lstat()
        except FileNotFoundError:
            return f"{path} was removed: another mirrord may now work on this mirror"
        except OSError as exc:
            return f"{path}: cannot stat the lock file: {exc.strerror or exc}"
        ours = os.fstat(self._lock_fd)
        if there.st_dev != ours.st_dev and self.identity_problem() is None:
            try:
                fd = self._acquire_lock()
            except (LockedError, OSError) as exc:
                return f"{path}: the mirror was mounted again and its lock cannot be taken: {exc}"
            os.close(self._lock_fd)
            self._lock_fd = fd
            return None
        return f"{path} was replaced: another mirrord may now work on this mirror"


def _lock_holder(fd: int) -> str:
    """The holder as ' (pid N)', read from the lock file it wrote its pid into; '' if there is none yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


def _same_inode(fd: int, path: Path) -> bool:
    try:
        there = path.lstat()
    except FileNotFoundError:
        return False
    ours = os.fstat(fd)
    return (ours.st_dev, ours.st_ino) == (there.st_dev, there.st_ino)


if TYPE_CHECKING:  # mypy proves here that the local implementation is a whole Mirror
    _LOCAL_IS_A_MIRROR: type[Mirror] = LocalMirror
    _LOCAL_IS_READABLE: type[ReadableStore] = LocalVolume
