"""Which checkpoint should a training script resume from? The newest one that is provably whole."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from mirrord.manifest import Manifest
from mirrord.model import FileState, ManifestEntry, step_of
from mirrord.scan import snapshot_tree
from mirrord.verify import check_entry


def _run_key(root: Path, run: str | Path | None) -> str | None:
    if run is None:
        return None
    run_path = Path(run)
    if run_path.is_absolute():
        run_path = run_path.resolve().relative_to(root.resolve())
    key = run_path.as_posix()
    return "" if key == "." else key.strip("/")


def _newest_first(entry: ManifestEntry) -> tuple[int, int]:
    return (entry.step if entry.step is not None else -1, entry.source_mtime_ns)


def latest_checkpoint(
    root: str | Path,
    run: str | Path | None = None,
    require_manifest: bool = True,
    patterns: Iterable[str] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
) -> Path | None:
    """The newest checkpoint (highest step) under `root` whose size and hash match the manifest.

    A newer file that is truncated, corrupt or unrecorded is skipped, never returned. With
    `require_manifest=False` and no manifest at `root` (a primary volume), the newest file that passes
    the structural torch-zip check (every record's CRC) is returned instead.
    """
    root = Path(root)
    run_key = _run_key(root, run)
    manifest = Manifest.load(root)
    if len(manifest) or require_manifest:
        entries = [e for e in manifest.entries.values() if run_key is None or e.run == run_key]
        for entry in sorted(entries, key=_newest_first, reverse=True):
            if check_entry(root, entry) is None:
                return root / entry.path
        return None
    from mirrord.zipcheck import check_torch_zip  # structural check; stdlib only, no torch import

    snap = snapshot_tree(root, patterns)
    step_regex = re.compile(step_pattern)
    states = [s for s in snap.files.values() if run_key is None or s.run == run_key]
    def newest(state: FileState) -> tuple[int, int]:
        step = step_of(state.rel, step_regex)
        return (step if step is not None else -1, state.mtime_ns)

    states.sort(key=newest, reverse=True)
    for state in states:
        if check_torch_zip(root / state.rel).status == "ok":
            return root / state.rel
    return None
