"""The storage seam: everything mirrord asks of a mirror, over keys, never over `Path`.

A key is a root-relative POSIX path (`run/step_10.pt`): the same string in the manifest, in a
snapshot, in a copy job and in a prune plan. It never starts with '/', never holds '', '.' or '..'
parts (mirrord.paths.split_rel refuses those, and an implementation must too).

Two implementations keep the same promises:

* `LocalMirror` (mirrord.store.volume): a directory tree on a local disk, NFS, SMB or a FUSE bridge.
  Publishing is the atomic protocol (NAME.part, fsync, verify, os.replace, fsync of the directory),
  every open goes beneath the root without following a symlink, and the volume is pinned while the
  lock is held (mirrord.store.identity).
* `S3Mirror` (mirrord.store.s3): an object is visible only once its upload completes; a folder unit's
  files go under their final keys and its manifest entry is the unit's commit point.

Callers (the copier, the engine, prune, verify, latest, status, repair) use only what is declared
here; errors they raise name `describe(key)`, a path for a local mirror and `s3://bucket/key` for S3.
The contract tests in tests/unit/test_mirror_contract.py run against every implementation (S3's run:
tests/s3/test_contract.py, on a real server).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, Protocol

from mirrord.core.model import FileState, ManifestEntry, Snapshot, version_key
from mirrord.layouts import Layout
from mirrord.store.atomic import DirSyncs
from mirrord.store.manifest import Manifest

# What a spool of a non-file stream (an object being read back) is copied in.
_SPOOL_CHUNK = 8 * 1024 * 1024


class Upload(Protocol):
    """One object being written where no reader sees it; it appears under its key only at commit().

    The order is always write/skip ... -> seal -> commit, or abort at any point (abort after commit,
    or twice, does nothing). Until commit a crash leaves no object under the key (at most a staging
    leftover that a later upload of the same key replaces, or a sweep removes).
    """

    def write(self, data: memoryview) -> None:
        """Append bytes. The buffer is reused by the caller once this returns."""

    def skip(self, nbytes: int) -> None:
        """Append `nbytes` zero bytes (a hole in a sparse source; a store without holes writes zeros)."""

    def seal(self, mtime_ns: int) -> int | None:
        """Make the written bytes durable, give them the source's mtime, and check the size that was
        announced at begin_upload (SizeMismatchError otherwise). A small local file may leave its fsync
        to commit(), which makes it before the rename (or leaves both to dirs.flush()). Returns the
        mtime the store really keeps (a filesystem may clamp or round it), or None when it keeps none.
        After a failed seal only abort() is allowed: the data may be lost even if a retry would report
        success."""

    def commit(self, dirs: DirSyncs | None = None) -> int | None:
        """Publish: the key now names exactly the sealed bytes, durably (local: os.replace + fsync of
        the directory; with `dirs`, that fsync is added to dirs and the key is durable only once
        dirs.flush() returned: group commit; a local file whose fsync seal() left is then fsynced and
        renamed by dirs.flush() too, and its key exists only once that flush ran). Raises if the staging
        object is no longer ours (replaced meanwhile). Returns the mtime the store keeps when it is
        known only once published (an object's LastModified, which snapshot() then reports), else None
        (seal() said it)."""

    def abort(self) -> None:
        """Drop the staging object; never raises (it must not mask the error that caused it)."""


class UnitStaging(Protocol):
    """A folder unit (a checkpoint made of several files) being published as a whole.

    Local: files are written into `NAME.part/` next to the final `NAME/`; commit() renames the folder
    in one step, so `NAME/` never exists partially. Object store: files go under their final keys (no
    rename of a prefix exists) and nothing here makes them trusted: the caller's manifest record of
    the unit is the commit point, and readers trust only units in the manifest.

    Use: `staging = mirror.begin_unit("run/checkpoint-50")`; for each file `up =
    staging.upload("model.safetensors", size)` then write/seal/commit on `up` (that commit makes the
    file durable inside the staging area only); then `staging.commit()`, or `staging.abort()`.
    """

    key: str  # the unit's final key, e.g. "run/checkpoint-50"
    # True: commit() replaces an older copy under the key itself, which stays whole until then (local:
    # the names are exchanged in one step). False: the caller deletes the older copy before commit().
    replaces: bool

    def upload(self, relkey: str, size: int, drop_cache: bool = False) -> Upload:
        """Begin one file of the unit; `relkey` is relative to the unit (`model.safetensors`, `sub/x`)."""

    def commit(self) -> None:
        """Make the whole unit visible under its key at once (local: fsync, rename or exchange with an
        older copy, fsync parent, remove the older copy). Never merges into an older copy: where
        `replaces` is False, FileExistsError while one is there (delete it first, through the guards)."""

    def abort(self) -> None:
        """Remove everything staged so far; never raises."""


class UploadTarget(Protocol):
    """What the copier needs to publish one file: a Mirror, or one folder unit's staging area."""

    def describe(self, key: str = "") -> str:
        """A human name for the store or one key (see ReadableStore.describe)."""

    def space(self) -> tuple[int, int] | None:
        """(bytes free, total bytes), or None when unknown (see Mirror.space)."""

    def begin_upload(self, key: str, size: int, drop_cache: bool = False) -> Upload:
        """Start publishing one object of `size` bytes under `key`; see Upload."""


class Beside:
    """A mirror as the copier's UploadTarget for a version: a copy of `key` is published at version_key(key),
    beside the verified copy under `key` (mirrord.core.model.VERSIONS)."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    def describe(self, key: str = "") -> str:
        """The version's path."""
        return self.mirror.describe(version_key(key))

    def space(self) -> tuple[int, int] | None:
        """The mirror's (free, total) bytes."""
        return self.mirror.space()

    def begin_upload(self, key: str, size: int, drop_cache: bool = False) -> Upload:
        """Begin writing the version of `key` under its temp name."""
        return self.mirror.begin_upload(version_key(key), size, drop_cache)


class ReadableStore(Protocol):
    """What read-only commands need from a volume: `latest`, `verify` and `status` (no lock taken)."""

    def describe(self, key: str = "") -> str:
        """A human name for the store (key "") or for one key, for messages and error paths."""

    def exists(self) -> bool:
        """The store is there to be read (a local root directory exists; a bucket answers)."""

    def snapshot(self, patterns: Iterable[str], layout: Layout | None = None) -> Snapshot:
        """List every candidate key matching `patterns` or the layout's names; in `partials` the
        leftovers of single uploads, in `staging` (folder layouts) the units being staged. Listing
        problems are collected in `errors`, never raised: such a view is partial."""

    def stat(self, key: str) -> FileState | None:
        """The key's current state, None if nothing is there. ValueError for an unsafe key."""

    def open_read(self, key: str) -> BinaryIO:
        """A stream of the key's bytes from the start, for hashing and validating (verify, latest,
        status). FileNotFoundError if absent; OSError if it is not a regular file/object. Close it."""

    def load_manifest(self) -> Manifest:
        """The manifest as it is now, read-only (empty if there is none). ManifestError if damaged."""

    def local_tree(self) -> LocalTree | None:
        """The store as a directory tree (roots that may nest, layouts judged by their files), or None
        for an object store."""


class LocalTree(ReadableStore, Protocol):
    """A store that is a directory tree beneath `root` (mirrord.store.volume.LocalVolume): what a caller of
    local_tree() may use besides reading, described here so that the seam imports none of its implementations."""

    root: Path
    exclude: frozenset[tuple[int, int]]  # (dev, ino) of a root a listing never enters

    def key(self) -> tuple[int, int]:
        """(device, inode) of the root directory."""


class Mirror(ReadableStore, UploadTarget, Protocol):
    """The mirror: a ReadableStore that mirrord publishes into, prunes and records in.

    Writes (begin_upload, begin_unit, delete, the manifest's changes) happen only while lock() is held,
    and each first checks that the mirror is still the volume the lock was taken on (check_identity).
    """

    # Whether a published copy has an inode and a ctime worth recording in its manifest entry (a file
    # system: `latest` then trusts the entry by stat alone). An object store has neither: no stat is made.
    has_inodes: bool
    # This node's name in a prefix several nodes share (its entries are its own: mirrord.core.nodes);
    # "" for a mirror only this node writes.
    node: str

    def begin_unit(self, key: str) -> UnitStaging:
        """Start publishing a folder unit under `key`; see UnitStaging."""

    def clone(self, source_key: str, key: str, expected: FileState) -> FileState | None:
        """Publish `key` with exactly the bytes of the stored `source_key`, which must still be `expected`,
        without sending them again (local: a hard link; object store: a server-side copy), published
        as atomically as an upload. Returns the new key's state, or None where the store cannot (the
        caller uploads instead)."""

    def rename(self, key: str, other: str, keep: bool = False) -> bool:
        """Put the object `key` under `other`, in place of what is there (a version promoted over the copy it
        replaces), or with `keep` give it the second name `other`; False where the store cannot keep it under
        a second name (nothing done). Local: a rename or a hard link; object store: a server-side copy, then
        the delete of `key` (S3Mirror.rename: not one step)."""

    def delete(self, key: str, expected: FileState) -> None:
        """Delete `key` only if it is still exactly `expected` (local: inode, size, mtime, regular file),
        checked just before deleting. ChangedError (mirrord.errors) if it is not; nothing if it
        is already gone; a MirrordError naming describe(key) on failure."""

    def delete_folder(self, key: str, expected: FileState | None = None) -> bool:
        """Remove the folder `key`: with `expected`, a dead staging folder (still that one) and all in
        it; without, a unit folder whose files were deleted, only if empty. True if it is gone (an
        object store, having no folders, removes what is left under the prefix only with `expected`),
        False if it was left (not empty, or not the planned folder)."""

    def delete_unit(self, key: str, files: Iterable[tuple[str, FileState]]) -> None:
        """Retire the folder unit `key` whole, its `files` re-checked and their manifest entries dropped
        by the caller (local: renamed aside in one step, then removed; object store: file by file, then
        the prefix)."""

    def claim_retention(self) -> str | None:
        """None if this node may prune the mirror now, else who does or why not (several nodes sharing
        an object-store prefix: the holder of its retention lease). Local: always None."""

    def require_retention(self) -> None:
        """Before each deletion on the mirror: raise unless this node still may prune it (local: no-op)."""

    def sweep_stale_uploads(self, older_than: float) -> int:
        """Abort the uploads killed writers left, older than `older_than` seconds; how many (local: 0,
        a dead .part is swept by the listing)."""

    def read_manifest(self) -> Manifest:
        """The manifest open for changes (each durable before it counts), for the lock holder."""

    def set_manifest_aside(self, suffix: str) -> list[str]:
        """Move the stored manifest (snapshot and journals) aside under names ending in `suffix`, for
        `repair-manifest`; returns the new names. Nothing is deleted. ManifestError on failure."""

    def link_aliases(
        self, primary_root: Path, links: list[str], entries: Mapping[str, ManifestEntry]
    ) -> list[tuple[str, str]]:
        """Recreate the primary's alias symlinks `links` (last.ckpt) whose target is recorded in `entries`;
        returns (alias, target) for each link made. An object store has no symlinks: none is made."""

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive use by one mirrord process (LockedError if another holds it); pins the mirror."""

    def check_identity(self) -> None:
        """Raise MirrorGoneError if the mirror is no longer the one pinned by lock() (no-op unlocked)."""

    def identity_problem(self) -> str | None:
        """check_identity as a sentence, or None while all is well."""

    def lock_problem(self) -> str | None:
        """None while our lock still holds; else why it was lost (another mirrord may be working)."""

    def write_problem(self) -> str | None:
        """None while publishing is safe; else why not right now. Local: always None (the flock holds
        while the process lives). Object store: the lease was not renewed in time (it may come back:
        copies and prunes wait) or is lost. Never waits on the store: the probes call it."""

    def keep_modes_of(self, primary: Path) -> None:
        """Folders and files created from now on keep the primary's permission bits (local only)."""

    def is_mountpoint(self) -> bool | None:
        """For `mirror_must_be_mountpoint`: is the root a mount point? None where that means nothing."""


@contextlib.contextmanager
def random_access_fd(stream: BinaryIO) -> Iterator[int]:
    """A file descriptor with the stream's bytes, for readers that need pread (the format validators,
    torch.load): the stream's own descriptor when it has one, else the stream copied into an unlinked
    temporary file (an object read back from a store). The descriptor is valid inside the block."""
    try:
        fd = stream.fileno()
    except (OSError, io.UnsupportedOperation):
        fd = -1
    if fd >= 0:
        yield fd
        return
    import tempfile  # (only for objects of a store: a local command's start-up does not pay for it)

    with tempfile.TemporaryFile(prefix="mirrord-spool-") as spool:
        while chunk := stream.read(_SPOOL_CHUNK):
            spool.write(chunk)
        spool.flush()
        yield spool.fileno()


def fd_path(fd: int) -> str:
    """A path that opens the very file behind `fd` (for APIs that take a path, like torch.load)."""
    return f"/proc/self/fd/{fd}"
