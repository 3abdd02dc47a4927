"""Bringing a checkpoint back from the mirror: the newest verified unit, checked byte for byte as it is written.

    for each file of the unit: NAME.part (a folder: NAME.part/) <- the mirror's bytes, hashed as they pass;
    size and hash as the manifest recorded, or nothing is published -> fsync -> rename -> fsync directory

The restored file gets the source mtime the manifest recorded, so that `sync` and the daemon see the
very file they mirrored (mirrord.core.plan.why_copy: same size, same mtime) and copy nothing again.
Only reads the mirror: it works with read access alone (a read-only mount, a read-only S3 policy).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from mirrord.core.layouts import Layout
from mirrord.core.model import ManifestEntry
from mirrord.errors import DamagedCopyError, DestinationTakenError, NothingToRestoreError, from_oserror
from mirrord.paths import lstat_beneath
from mirrord.store.hashing import HASH_BUFFER_BYTES, new_hasher
from mirrord.store.mirror import ReadableStore, Upload
from mirrord.store.resume import Candidate, check_entry, newest_run, recorded_candidates, recorded_manifest
from mirrord.store.volume import LocalVolume

Progress = Callable[[int, int, str], None]  # (bytes done, bytes in all, key)


@dataclass(frozen=True)
class Restored:
    """What restore did: the unit it brought back (or found already there) and the damaged copies it passed over."""

    key: str
    path: Path
    step: int | None
    already_there: bool
    size: int
    damaged: tuple[DamagedCopyError, ...] = ()


def restore(
    store: ReadableStore,
    dest_root: Path,
    layout: Layout | None = None,
    run: str | None = None,
    step: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Restored:
    """Restore the newest verified unit of `run` (the run written to most recently when None; the unit of
    `step` when given) below `dest_root`, at its key. A damaged copy is never published: without `step` the
    next newest unit is tried (each one passed over is in `damaged`), with it DamagedCopyError is raised.
    NothingToRestoreError when no unit matches; DestinationTakenError when something else is at the
    destination and not `force`."""
    runs = recorded_candidates(recorded_manifest(store, layout), run)
    chosen = run if run is not None else newest_run(runs)
    candidates = runs.get(chosen, []) if chosen is not None else []
    if step is not None:
        candidates = [c for c in candidates if c.step == step]
    if not candidates:
        wanted = (f" of run {run!r}" if run is not None else "") + (f" at step {step}" if step is not None else "")
        raise NothingToRestoreError(store.describe(), f"no verified checkpoint{wanted} in the manifest")
    damaged: list[DamagedCopyError] = []
    for candidate in candidates:
        try:
            already = _restore_unit(store, candidate, Path(dest_root), force, progress)
        except DamagedCopyError as exc:
            damaged.append(exc)
            if step is not None:
                raise
            continue
        except OSError as exc:  # the destination refused (permissions, space, a folder in the way)
            raise from_oserror(Path(dest_root) / candidate.key, exc, "restore") from exc
        size = sum(e.size for e in candidate.entries)
        return Restored(candidate.key, Path(dest_root) / candidate.key, candidate.step, already, size, tuple(damaged))
    raise damaged[-1]


def _restore_unit(
    store: ReadableStore, unit: Candidate, dest_root: Path, force: bool, progress: Progress | None
) -> bool:
    """Publish one unit below dest_root; True when an identical copy was already there."""
    dest_root.mkdir(parents=True, exist_ok=True)
    if lstat_beneath(dest_root, unit.key) is not None:
        if _identical(dest_root, unit):
            return True
        if not force:
            raise DestinationTakenError(
                dest_root / unit.key,
                "exists and is not the mirrored checkpoint; --force replaces it (nothing was written)",
            )
    total = sum(e.size for e in unit.entries)
    done = 0
    buffer = memoryview(bytearray(HASH_BUFFER_BYTES))

    def publish(upload: Upload, entry: ManifestEntry) -> None:
        """The entry's bytes from the mirror into `upload`, published only if they are the recorded ones."""
        nonlocal done
        hasher, size = new_hasher(entry.algo), 0
        try:
            try:
                stream = store.open_read(entry.path)
            except FileNotFoundError as exc:
                raise DamagedCopyError(store.describe(entry.path), "in the manifest but not on the mirror") from exc
            with stream:
                while n := cast("io.BufferedIOBase", stream).readinto(buffer):  # a local file or an S3 body
                    hasher.update(buffer[:n])
                    upload.write(buffer[:n])
                    size += n
                    done += n
                    if progress is not None:
                        progress(done, total, entry.path)
            digest = hasher.hexdigest()
            if (size, digest) != (entry.size, entry.digest):
                raise DamagedCopyError(
                    store.describe(entry.path),
                    f"the mirror's copy does not match the "
                    f"manifest ({size} bytes, {entry.algo} {digest}; recorded: {entry.size} "
                    f"bytes, {entry.digest}): not restored",
                )
            upload.seal(entry.source_mtime_ns)
            upload.commit()
        except BaseException:
            upload.abort()
            raise

    if not unit.folder:
        from mirrord.store.upload import LocalUpload

        publish(LocalUpload(dest_root, unit.key, unit.entries[0].size), unit.entries[0])
        return False
    from mirrord.store.staging import FolderStaging

    staging = FolderStaging(dest_root, unit.key)
    try:
        for entry in unit.entries:
            publish(staging.upload(entry.path[len(unit.key) + 1 :], entry.size), entry)
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return False


def _identical(dest_root: Path, unit: Candidate) -> bool:
    """The destination holds exactly the unit's recorded files (a folder: and nothing else), by content."""
    if unit.folder:
        folder = dest_root / unit.key
        if not folder.is_dir() or folder.is_symlink():
            return False
        found = {p.relative_to(dest_root).as_posix() for p in folder.rglob("*") if not p.is_dir()}
        if found != {e.path for e in unit.entries}:
            return False
    volume = LocalVolume(dest_root)  # not there, not a file, unreadable: not the checkpoint
    return all(check_entry(volume, entry) is None for entry in unit.entries)
