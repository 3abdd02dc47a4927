"""Which checkpoint should a training script resume from? The newest one that is provably whole.

On a mirror, "provably whole" means: recorded in the manifest (so it was published only after its
source passed its format validator), and the file on disk is still the one recorded. That last point
is answered without reading multi-GB files on every call: the manifest records the published copy's
inode, size, mtime and ctime, and while they are unchanged the recorded hash still holds. An entry
without that record, or whose file changed by stat, is re-hashed and re-validated; `verify=True`
re-reads every candidate.

"Newest" is per run by (branch, step): after a rollback (a lower step written after a higher one,
see mirrord.core.branches) the new branch wins. Across runs, step numbers are never compared: the run
whose best checkpoint has the newest mtime wins.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from mirrord.core.branches import branches, lying_after_ns
from mirrord.core.layouts import TEMP_SUFFIXES, Layout
from mirrord.core.model import FileState, ManifestEntry, entry_passed, step_of
from mirrord.errors import UnsafePathError
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import ReadableStore
from mirrord.store.volume import LocalVolume

if TYPE_CHECKING:
    from mirrord.commands.verify import Finding
    from mirrord.core.units import Unit
    from mirrord.formats.validators import Verdict

# Re-reading (mirrord.commands.verify: hashing, the format validators) and judging a primary's folder
# units (mirrord.service.completeness) are imported where they are needed: the usual answer is a
# manifest read and a few stats, and a training script waits on it. So are folder units
# (mirrord.core.units): a file layout's answer has none.

FUTURE_SKEW_SECONDS = 60.0  # as prune.future_skew_seconds' default


def run_key(store: ReadableStore, run: str | Path | None) -> str | None:
    """The run `--run` names, as a key prefix: relative as given ('' for the top), or an absolute path
    below a local store's root. ValueError (a sentence) when it is neither."""
    if run is None:
        return None
    run_path = Path(run)
    if run_path.is_absolute():
        root = Path(store.describe())
        if not root.is_absolute() or not run_path.resolve().is_relative_to(root.resolve()):
            raise ValueError(f"{run} is not a folder under {store.describe()}")
        run_path = run_path.resolve().relative_to(root.resolve())
    key = run_path.as_posix()
    return "" if key == "." else key.strip("/")


def _by_recency(items: list[tuple[int | None, int, object]]) -> list[object]:
    """(step, mtime_ns, item) newest first: by branch and step, stepless items by mtime after them."""
    mtimes: dict[int, int] = {}
    lie = lying_after_ns(time.time(), FUTURE_SKEW_SECONDS)  # beyond: a lying clock, no evidence of order
    for step, mtime, _ in items:
        if step is not None:
            mtimes[step] = max(mtimes.get(step, 0), 0 if mtime > lie else mtime)
    order = branches(mtimes)
    def key(item: tuple[int | None, int, object]) -> tuple[int, int, int, int]:
        step, mtime, _ = item
        if step is None:
            return (0, 0, 0, mtime)
        branch, _ = order.key(step)
        return (1, branch, step, mtime)
    return [item for _, _, item in sorted(items, key=key, reverse=True)]


def check_entry(store: ReadableStore, entry: ManifestEntry) -> Finding | None:
    """mirrord.commands.verify.check_entry (size and content hash), imported on first use."""
    from mirrord.commands import verify

    return verify.check_entry(store, entry)


def validate_key(store: ReadableStore, key: str) -> Verdict:
    """mirrord.commands.verify.validate_key (the format validator), imported on first use."""
    from mirrord.commands import verify

    return verify.validate_key(store, key)


def entry_intact(store: ReadableStore, entry: ManifestEntry, verify: bool = False) -> bool:
    """The file is what the manifest recorded and passed its validator.

    Trusted by stat (inode, size, mtime, ctime as recorded) unless `verify`; otherwise re-hashed and,
    for entries recorded before validation existed, validated.
    """
    if not entry_passed(entry):
        return False
    if not verify:
        try:
            state = store.stat(entry.path)
        except (OSError, UnsafePathError):
            return False
        if state is None or not state.is_regular:
            return False
        if entry.unchanged(state):
            return True
    if check_entry(store, entry) is not None:
        return False
    if entry.validation is not None and not verify:
        return True  # the bytes are the ones that passed when they were copied
    return validate_key(store, entry.path).passed


def latest_key(
    store: ReadableStore,
    run_key: str | None = None,
    require_manifest: bool = True,
    patterns: Iterable[str] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
    verify: bool = False,
    layout: Layout | None = None,
) -> str | None:
    """The key of the newest whole checkpoint in `store` (of the run `run_key`, or of the run written
    to most recently); see latest_checkpoint. Works on any store: a local tree or the mirror's seam.
    With a folder layout the answer is a unit's folder."""
    manifest = store.load_manifest()
    if layout is not None and layout.folders:
        return _latest_unit(store, run_key, manifest, layout, require_manifest, verify)
    if len(manifest) or require_manifest:
        runs: dict[str, list[tuple[int | None, int, object]]] = defaultdict(list)
        for e in manifest.entries.values():
            if run_key is None or e.run == run_key:
                runs[e.run].append((e.step, e.source_mtime_ns, e))
        found: list[ManifestEntry] = []
        for items in runs.values():
            for entry in _by_recency(items):
                assert isinstance(entry, ManifestEntry)
                if entry_intact(store, entry, verify):
                    found.append(entry)
                    break
        if not found:
            return None
        lie = lying_after_ns(time.time(), FUTURE_SKEW_SECONDS)
        return max(found, key=lambda e: 0 if e.source_mtime_ns > lie else e.source_mtime_ns).path
    snap = store.snapshot(patterns)
    step_regex = re.compile(step_pattern)
    by_run: dict[str, list[tuple[int | None, int, object]]] = defaultdict(list)
    for s in snap.files.values():
        if run_key is None or s.run == run_key:
            by_run[s.run].append((step_of(s.rel, step_regex), s.mtime_ns, s))
    best: list[FileState] = []
    for items in by_run.values():
        for state in _by_recency(items):
            assert isinstance(state, FileState)
            # Stricter than passing: on a primary with no manifest, only a verdict of "ok" proves anything.
            if validate_key(store, state.rel).status == "ok":
                best.append(state)
                break
    return max(best, key=lambda s: s.mtime_ns).rel if best else None


def latest_checkpoint(
    root: str | Path,
    run: str | Path | None = None,
    require_manifest: bool = True,
    patterns: Iterable[str] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
    verify: bool = False,
    layout: Layout | None = None,
) -> Path | None:
    """The newest whole checkpoint under `root` (of `run`, or of the run written to most recently).

    On a mirror: only manifest entries whose file is still the one recorded (see entry_intact); a newer
    file that is truncated, corrupt or unrecorded is skipped, never returned. With
    `require_manifest=False` and no manifest at `root` (a primary volume), the newest file that passes
    its format validator with a verdict of "ok" (a torch zip: every record's CRC) is returned instead.
    """
    root = Path(root)
    store = LocalVolume(root)
    key = latest_key(store, run_key(store, run), require_manifest, patterns, step_pattern, verify, layout)
    return None if key is None else root / key


def _latest_unit(
    store: ReadableStore, run_key: str | None, manifest: Manifest, layout: Layout, require_manifest: bool,
    verify: bool,
) -> str | None:
    """The newest whole folder unit: on a mirror, one whose every file is recorded and intact and whose
    folder holds exactly the recorded files; on a primary without a manifest, the newest folder that
    its layout's completeness rule calls whole."""
    from mirrord.core.units import Unit, group_units, locate

    if len(manifest) or require_manifest:
        members: dict[str, list[ManifestEntry]] = defaultdict(list)
        places = {}
        for e in manifest.entries.values():
            place = locate(e.path, layout)
            if place is not None and place.kind == "folder" and (run_key is None or place.run == run_key):
                members[place.unit].append(e)
                places[place.unit] = place
        runs: dict[str, list[tuple[int | None, int, object]]] = defaultdict(list)
        for unit, entries in members.items():
            runs[places[unit].run].append((places[unit].step, max(e.source_mtime_ns for e in entries), unit))
        listing: list[str] | None = None  # one listing of the store, only when a unit is to be checked
        found: list[tuple[int, str]] = []
        for items in runs.values():
            for key in _by_recency(items):
                assert isinstance(key, str)
                if listing is None:
                    listing = sorted(store.snapshot((), layout).files)
                if _unit_intact(store, key, members[key], listing, verify):
                    found.append((max(e.source_mtime_ns for e in members[key]), key))
                    break
        return max(found)[1] if found else None
    if not isinstance(store, LocalVolume):
        return None  # a primary is a local tree; judging completeness needs one
    from mirrord.service.completeness import judge

    units = group_units(store.snapshot((), layout).files.values(), layout)
    complete = judge(store, layout)
    by_run: dict[str, list[tuple[int | None, int, object]]] = defaultdict(list)
    for listed in units.values():
        if listed.role == "checkpoint" and (run_key is None or listed.run == run_key):
            by_run[listed.run].append((listed.step, listed.mtime_ns, listed))
    best: list[Unit] = []
    for items in by_run.values():
        for candidate in _by_recency(items):
            assert isinstance(candidate, Unit)
            if complete(candidate).complete:
                best.append(candidate)
                break
    return max(best, key=lambda u: u.mtime_ns).rel if best else None


def _unit_intact(store: ReadableStore, unit: str, entries: list[ManifestEntry], listing: list[str],
                 verify: bool) -> bool:
    """Every recorded file intact, and nothing else in the folder: the unit as it was published."""
    prefix = unit + "/"
    there = {rel for rel in listing if rel.startswith(prefix) and not rel.endswith(TEMP_SUFFIXES)}
    if there != {e.path for e in entries}:
        return False
    return all(entry_intact(store, e, verify) for e in entries)
