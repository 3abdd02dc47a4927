"""Bringing a checkpoint back from the mirror: the newest verified unit, checked byte for byte as it is written.

    for each file of the unit: NAME.part (a folder: NAME.part/) <- the mirror's bytes, hashed as they pass;
    size and hash as the manifest recorded, or nothing is published -> fsync -> rename -> fsync directory

The restored file gets the source mtime the manifest recorded, so that `sync` and the daemon see the
very file they mirrored (mirrord.core.plan.why_copy: same size, same mtime) and copy nothing again.
The files the layout's resume reads beside the units, when the run's record holds them, then point at the
restored unit: DeepSpeed's `latest` and Megatron's tracker name it, Lightning's `last.ckpt` is a copy of it.
Only reads the mirror: it works with read access alone (a read-only mount, a read-only S3 policy).
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from mirrord.core.model import ManifestEntry
from mirrord.errors import (
    ChangedError,
    DamagedCopyError,
    DestinationTakenError,
    NothingToRestoreError,
    UnsafePathError,
    WhichRunError,
    from_oserror,
)
from mirrord.layouts import MEGATRON_TRACKER, Layout
from mirrord.paths import lstat_beneath, source_modes
from mirrord.store.atomic import atomic_output
from mirrord.store.hashing import HASH_BUFFER_BYTES, new_hasher
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import ReadableStore, Upload
from mirrord.store.resume import Candidate, check_entry, recorded_candidates, recorded_manifest
from mirrord.store.volume import LocalVolume

Progress = Callable[[int, int, str], None]  # (bytes done, bytes in all, key)
REPLANS = 5  # plans from a re-read manifest, when units change under a restore (retention retired them)


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
    """Restore the newest verified unit of `run` (None: the mirror's only run; the unit of `step` when given)
    below `dest_root`, at its key. A damaged or unreadable copy is never published: without `step` the next
    newest unit is tried (each one passed over is in `damaged`), with it DamagedCopyError is raised. A unit
    the manifest no longer records as planned (retention retired it meanwhile) is not damaged: planned again.
    NothingToRestoreError when no unit matches; WhichRunError; DestinationTakenError when something else is
    at the destination and not `force`."""
    manifest, replans = recorded_manifest(store, layout), 0
    while True:
        runs = recorded_candidates(manifest)
        candidates = runs.get(_chosen_run(store, manifest.entries, runs, run) or "", [])
        if step is not None:
            candidates = [c for c in candidates if c.step == step]
        if not candidates:
            wanted = (f" of run {run!r}" if run is not None else "") + (f" at step {step}" if step is not None else "")
            raise NothingToRestoreError(store.describe(), f"no verified checkpoint{wanted} in the manifest")
        damaged: list[DamagedCopyError] = []
        for candidate in candidates:
            try:
                already = _restore_unit(store, candidate, Path(dest_root), force, progress)
                _point_resume(manifest, candidate, Path(dest_root), force)
            except DamagedCopyError as exc:
                fresh = recorded_manifest(store, layout) if replans < REPLANS else manifest
                if any(fresh.entries.get(e.path) != e for e in candidate.entries):
                    manifest, replans = fresh, replans + 1
                    break
                damaged.append(exc)
                if step is not None:
                    raise
                continue
            except OSError as exc:  # the destination refused (permissions, space, a folder in the way)
                raise from_oserror(Path(dest_root) / candidate.key, exc, "restore") from exc
            size = sum(e.size for e in candidate.entries)
            path = Path(dest_root) / candidate.key
            return Restored(candidate.key, path, candidate.step, already, size, tuple(damaged))
        else:
            raise damaged[-1]


def _chosen_run(
    store: ReadableStore, recorded: Iterable[str], runs: dict[str, list[Candidate]], run: str | None
) -> str | None:
    """`run`, or the only run with a checkpoint. WhichRunError, listing the runs, for a run the manifest records
    nothing of, or for no `run` when there are several: one of them would hand a job another run's checkpoint."""
    listed = ", ".join(repr(r) for r in sorted(runs)) or "none"
    if run is not None and run not in runs and not any(path.startswith(f"{run}/") for path in recorded):
        raise WhichRunError(store.describe(), f"no run {run!r} on the mirror; its runs: {listed}")
    if run is None and len(runs) > 1:
        raise WhichRunError(store.describe(), f"{len(runs)} runs on the mirror ({listed}): name the one to restore")
    return run if run is not None else next(iter(runs), None)


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
        """The entry's bytes from the mirror into `upload`, published only if they are the recorded ones;
        nothing past the recorded size is read (a copy that grew while read: its recorded bytes are checked)."""
        nonlocal done
        hasher, size = new_hasher(entry.algo), 0
        try:
            with _open_recorded(store, entry) as stream:
                while n := _read(store.describe(entry.path), stream, buffer[: min(len(buffer), entry.size - size)]):
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

    local = store.local_tree()  # a local mirror's folders and files keep their modes: private stays private
    modes_from = None if local is None else local.root
    if not unit.folder:
        from mirrord.store.upload import LocalUpload

        entry = unit.entries[0]
        publish(LocalUpload(dest_root, unit.key, entry.size, modes=source_modes(modes_from, unit.key)), entry)
        return False
    from mirrord.store.staging import FolderStaging

    staging = FolderStaging(dest_root, unit.key, modes_from)
    try:
        for entry in unit.entries:
            publish(staging.upload(entry.path[len(unit.key) + 1 :], entry.size), entry)
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return False


def _point_resume(manifest: Manifest, unit: Candidate, dest_root: Path, force: bool) -> None:
    """The run's recorded tag files (rewritten: they only name a folder) and aliases (written when absent, or
    with `force`: one may be newer than the mirror's) beside the restored unit, pointing at it, with its
    permission bits (a copy of a private checkpoint stays private)."""
    mode = (dest_root / unit.key).stat().st_mode & 0o666
    for entry in manifest.entries.values():
        path = dest_root / entry.path
        if entry.run != unit.run or entry.role not in ("tag", "alias"):
            continue
        if entry.role == "tag":
            with atomic_output(path, mode=mode) as out:
                out.write(str(unit.step if path.name == MEGATRON_TRACKER else Path(unit.key).name).encode())
        elif force or lstat_beneath(dest_root, entry.path) is None:
            with (dest_root / unit.key).open("rb") as restored, atomic_output(path, mode=mode) as out:
                shutil.copyfileobj(restored, out)


def _open_recorded(store: ReadableStore, entry: ManifestEntry) -> BinaryIO:
    """The mirror's copy of `entry`, opened only if it is a file of the recorded size (a stat, an S3 HEAD):
    DamagedCopyError naming the mirror file otherwise (missing, a symlink, a FIFO, a folder, unreadable)."""
    where = store.describe(entry.path)
    try:
        state = store.stat(entry.path)
        if state is not None and state.is_regular and state.size == entry.size:
            return store.open_read(entry.path)
    except (OSError, UnsafePathError) as exc:
        raise DamagedCopyError(where, f"unreadable on the mirror ({getattr(exc, 'strerror', None) or exc})") from exc
    if state is None:
        raise DamagedCopyError(where, "in the manifest but not on the mirror")
    why = "not a regular file" if not state.is_regular else f"{state.size} bytes"
    raise DamagedCopyError(where, f"{why} on the mirror, recorded {entry.size}: not restored")


def _read(where: str, stream: BinaryIO, into: memoryview) -> int:
    """readinto from the mirror's copy: a read error is the mirror file's (DamagedCopyError), not the destination's."""
    try:
        return cast("io.BufferedIOBase", stream).readinto(into)  # a local file or an S3 body
    except (OSError, ChangedError) as exc:  # ChangedError: an S3 object replaced while read
        raise DamagedCopyError(where, f"unreadable on the mirror ({getattr(exc, 'strerror', None) or exc})") from exc


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
