"""Which checkpoint should a training script resume from? The newest one that is provably whole.

On a mirror, "provably whole" means: recorded in the manifest (so it was published only after its
source passed its format validator), and the file on disk is still the one recorded. That last point
is answered without reading multi-GB files on every call: the manifest records the published copy's
inode, size, mtime and ctime, and while they are unchanged the recorded hash still holds. An entry
without that record, or whose file changed by stat, is re-hashed and re-validated; `verify=True`
re-reads every candidate.

"Newest" is per run by (branch, step): after a rollback (a lower step written after a higher one,
see mirrord.branches) the new branch wins. Across runs, step numbers are never compared: the run
whose best checkpoint has the newest mtime wins.
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from mirrord.branches import branches
from mirrord.manifest import Manifest
from mirrord.model import FileState, ManifestEntry, step_of
from mirrord.paths import open_file_beneath
from mirrord.retention import entry_passed
from mirrord.scan import snapshot_tree
from mirrord.validators import validate_fd
from mirrord.verify import check_entry
from mirrord.volume import LocalVolume

FUTURE_SKEW_SECONDS = 60.0  # as prune.future_skew_seconds' default


def _run_key(root: Path, run: str | Path | None) -> str | None:
    if run is None:
        return None
    run_path = Path(run)
    if run_path.is_absolute():
        run_path = run_path.resolve().relative_to(root.resolve())
    key = run_path.as_posix()
    return "" if key == "." else key.strip("/")


def _by_recency(items: list[tuple[int | None, int, object]]) -> list[object]:
    """(step, mtime_ns, item) newest first: by branch and step, stepless items by mtime after them."""
    mtimes: dict[int, int] = {}
    lie = (time.time() + FUTURE_SKEW_SECONDS) * 1e9  # beyond: a lying clock, no evidence of order
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


def entry_intact(root: Path, entry: ManifestEntry, verify: bool = False) -> bool:
    """The file is what the manifest recorded and passed its validator.

    Trusted by stat (inode, size, mtime, ctime as recorded) unless `verify`; otherwise re-hashed and,
    for entries recorded before validation existed, validated.
    """
    if not entry_passed(entry):
        return False
    if not verify:
        try:
            state = LocalVolume(root).stat(entry.path)
        except (OSError, ValueError):
            return False
        if state is None or not state.is_regular:
            return False
        if entry.unchanged(state):
            return True
    if check_entry(root, entry) is not None:
        return False
    if entry.validation is not None and not verify:
        return True  # the bytes are the ones that passed when they were copied
    return _validates(root, entry.path)


def _validates(root: Path, rel: str) -> bool:
    try:
        fd = open_file_beneath(root, rel)
    except OSError:
        return False
    try:
        return validate_fd(fd, rel).passed
    finally:
        os.close(fd)


def latest_checkpoint(
    root: str | Path,
    run: str | Path | None = None,
    require_manifest: bool = True,
    patterns: Iterable[str] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
    verify: bool = False,
) -> Path | None:
    """The newest whole checkpoint under `root` (of `run`, or of the run written to most recently).

    On a mirror: only manifest entries whose file is still the one recorded (see entry_intact); a newer
    file that is truncated, corrupt or unrecorded is skipped, never returned. With
    `require_manifest=False` and no manifest at `root` (a primary volume), the newest file that passes
    its format validator with a verdict of "ok" (a torch zip: every record's CRC) is returned instead.
    """
    root = Path(root)
    run_key = _run_key(root, run)
    manifest = Manifest.load(root)
    if len(manifest) or require_manifest:
        runs: dict[str, list[tuple[int | None, int, object]]] = defaultdict(list)
        for e in manifest.entries.values():
            if run_key is None or e.run == run_key:
                runs[e.run].append((e.step, e.source_mtime_ns, e))
        found: list[ManifestEntry] = []
        for items in runs.values():
            for entry in _by_recency(items):
                assert isinstance(entry, ManifestEntry)
                if entry_intact(root, entry, verify):
                    found.append(entry)
                    break
        if not found:
            return None
        lie = (time.time() + FUTURE_SKEW_SECONDS) * 1e9
        return root / max(found, key=lambda e: 0 if e.source_mtime_ns > lie else e.source_mtime_ns).path
    snap = snapshot_tree(root, patterns)
    step_regex = re.compile(step_pattern)
    by_run: dict[str, list[tuple[int | None, int, object]]] = defaultdict(list)
    for s in snap.files.values():
        if run_key is None or s.run == run_key:
            by_run[s.run].append((step_of(s.rel, step_regex), s.mtime_ns, s))
    best: list[FileState] = []
    for items in by_run.values():
        for state in _by_recency(items):
            assert isinstance(state, FileState)
            if _validates_ok(root, state.rel):
                best.append(state)
                break
    return root / max(best, key=lambda s: s.mtime_ns).rel if best else None


def _validates_ok(root: Path, rel: str) -> bool:
    """Stricter than passing: on a primary with no manifest, only a verdict of "ok" proves anything."""
    try:
        fd = open_file_beneath(root, rel)
    except OSError:
        return False
    try:
        return validate_fd(fd, rel).status == "ok"
    finally:
        os.close(fd)
