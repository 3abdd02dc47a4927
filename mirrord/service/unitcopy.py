"""Copy one folder unit to the mirror as a whole: every file through the copier into the staging
folder, then one rename. Readable in a minute.

    begin_unit(NAME) -> NAME.part/ -> copy_file(member) for each file (stream, hash, validate, fsync)
    -> the primary folder still holds exactly the planned files, unchanged? -> drop an old NAME/'s
    manifest entries -> commit: fsync NAME.part/, rename to NAME/ (or exchange with the old NAME/,
    then remove it), fsync the parent

Any failure aborts the staging (NAME.part/ removed) and raises the copier's typed error; NAME/ exists
on the mirror only whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.core.model import FileState
from mirrord.core.units import unit_identity
from mirrord.errors import InvalidSourceError, SourceChangedError, SourceGoneError
from mirrord.layouts import Layout
from mirrord.service.copier import CopyControl, CopyOptions, copy_file
from mirrord.store.mirror import Mirror, UnitStaging, Upload
from mirrord.store.staging import list_folder


class _Staged:
    """The copier's view of a staging area: a file of the unit goes to NAME.part/<member> (local), or
    under its final key (an object store: the manifest record is the unit's commit point)."""

    def __init__(self, mirror: Mirror, staging: UnitStaging, unit: str) -> None:
        self._mirror = mirror
        self._staging = staging
        self._prefix = unit + "/"

    def describe(self, key: str = "") -> str:
        return self._mirror.describe(key)

    def space(self) -> tuple[int, int] | None:
        return self._mirror.space()

    def begin_upload(self, rel: str, size: int, drop_cache: bool = False) -> Upload:
        self._mirror.check_identity()
        return self._staging.upload(rel.removeprefix(self._prefix), size, drop_cache)


def _invalid_unit(primary_root: Path, job: CopyJob, exc: InvalidSourceError) -> InvalidSourceError:
    """A file of the unit failed its validator: the unit is invalid as it is now, every file's identity
    recorded (not judged again until one changes); unknown if the file changed since it was judged."""
    member = Path(str(exc.path)).relative_to(primary_root / job.rel).as_posix()
    try:
        now = list_folder(primary_root, job.rel, Layout.is_member_name)
    except OSError:
        now = {}
    files = [FileState(rel, size, mtime, ino, 0, ctime_ns=ctime) for rel, (ino, size, mtime, ctime) in now.items()]
    judged = next((f.identity for f in files if f.rel == f"{job.rel}/{member}"), None)
    identity = unit_identity(files) if judged is not None and judged == exc.identity else None
    return InvalidSourceError(primary_root / job.rel, f"{member}: {exc.cause}", exc.status, identity)


def _listing(primary_root: Path, job: CopyJob) -> dict[str, tuple[int, int, int, int]]:
    """The folder's files as rel -> (ino, size, mtime_ns, ctime_ns): a member's content identity."""
    odd: list[str] = []
    try:
        found = list_folder(primary_root, job.rel, Layout.is_member_name, odd)
    except FileNotFoundError as exc:
        raise SourceGoneError(
            primary_root / job.rel, "deleted while it was being copied (rotated away by the trainer); copy discarded"
        ) from exc
    except OSError as exc:
        raise SourceChangedError(
            primary_root / job.rel, f"gone while it was being copied ({exc.strerror or exc}); copy discarded"
        ) from exc
    if odd:
        raise SourceChangedError(
            primary_root / job.rel,
            f"{min(odd)} is a symlink or not a regular file: the folder cannot be copied whole; copy discarded",
        )
    return found


def _copy_members(
    primary_root: Path,
    job: CopyJob,
    target: Mirror | _Staged,
    options: CopyOptions,
    control: CopyControl,
    results: list[CopyResult],
) -> None:
    """Copy every file of job.members through the copier to `target`, into `results` as each is done; the
    folder must hold exactly those files before, and still hold them unchanged after."""
    before = _listing(primary_root, job)
    if set(before) != set(job.members):
        raise SourceChangedError(
            primary_root / job.rel, "holds other files than when it was judged whole; judged again from a fresh listing"
        )
    member_options = dataclasses.replace(options, allow_empty=True)
    try:
        for rel in job.members:
            results.append(copy_file(primary_root, rel, target, member_options, control))
    except InvalidSourceError as exc:
        raise _invalid_unit(primary_root, job, exc) from exc
    # Still exactly the files copied, each the same inode with the same ctime as before the copy began (a
    # member replaced by one of the same size whose mtime was restored, as `rsync -a` or `cp -p` do, is
    # another file); else the copy is discarded.
    now = _listing(primary_root, job)
    if now != before or {rel: (size, mtime) for rel, (_ino, size, mtime, _ctime) in now.items()} != {
        r.rel: (r.size, r.source_mtime_ns) for r in results
    }:
        raise SourceChangedError(
            primary_root / job.rel, "files were added, removed or replaced while the folder was copied; copy discarded"
        )
    control.check(primary_root / job.rel)


def copy_part(
    primary_root: Path, job: CopyJob, mirror: Mirror, options: CopyOptions, control: CopyControl | None = None
) -> list[CopyResult]:
    """Upload this node's part of a folder unit whose other files are on other nodes (job.part): each
    file under its final key, through the copier (hashed, validated); the folder must still hold exactly
    those files, unchanged. Nothing here makes them trusted: the caller records them as this node's
    contribution (mirrord.core.contributions), and the unit counts only once the parts make it whole.
    A failure deletes the files this attempt published (only while still the objects it wrote)."""
    results: list[CopyResult] = []
    try:
        _copy_members(primary_root, job, mirror, options, control or CopyControl(), results)
    except BaseException:
        for done in results:
            stored = done.mirror_mtime_ns if done.mirror_mtime_ns is not None else done.source_mtime_ns
            with contextlib.suppress(Exception):  # a leftover is a stale part: retention's guards decide
                mirror.delete(done.rel, FileState(done.rel, done.size, stored))
        raise
    return results


def copy_unit(
    primary_root: Path,
    job: CopyJob,
    mirror: Mirror,
    options: CopyOptions,
    control: CopyControl | None = None,
    before_commit: Callable[[bool], None] = lambda _replaces: None,
) -> list[CopyResult]:
    """Publish the folder unit job.rel with every file in job.members, or raise and leave no trace.

    `before_commit(replaces)` runs once every file is staged and the source is known unchanged: the
    engine drops an older copy's manifest entries there, and its files too unless the commit replaces
    them itself (`replaces`: a local mirror swaps the whole new folder in, so a whole copy is always
    under the final name); a unit is replaced whole, never merged into.
    """
    staging = mirror.begin_unit(job.rel)
    results: list[CopyResult] = []
    try:
        _copy_members(primary_root, job, _Staged(mirror, staging, job.rel), options, control or CopyControl(), results)
        before_commit(staging.replaces)
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return results
