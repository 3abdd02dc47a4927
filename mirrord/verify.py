"""`mirrord verify`: recheck every mirrored artifact against the manifest (size, then content hash)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mirrord.hashing import hash_fd
from mirrord.manifest import Manifest
from mirrord.model import ManifestEntry
from mirrord.paths import open_file_beneath
from mirrord.scan import snapshot_tree
from mirrord.validators import OK, UNCHECKED, validate_fd


@dataclass(frozen=True)
class Finding:
    path: str
    problem: str  # missing | size_mismatch | hash_mismatch | unreadable | unrecorded | <validator status>
    detail: str = ""

    @property
    def is_problem(self) -> bool:
        """"unchecked" (a format without a validator) is worth reporting, never a failure."""
        return self.problem != UNCHECKED


def check_entry(root: Path, entry: ManifestEntry) -> Finding | None:
    """None if root/entry.path is exactly what the manifest recorded."""
    try:
        fd = open_file_beneath(root, entry.path)
    except FileNotFoundError:
        return Finding(entry.path, "missing", "in the manifest but not on the mirror")
    except OSError as exc:
        return Finding(entry.path, "unreadable", exc.strerror or str(exc))
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            return Finding(entry.path, "size_mismatch", f"{size} bytes on disk, manifest says {entry.size}")
        _, digest = hash_fd(fd, entry.algo)
    except OSError as exc:
        return Finding(entry.path, "unreadable", exc.strerror or str(exc))
    finally:
        os.close(fd)
    if digest != entry.digest:
        return Finding(entry.path, "hash_mismatch", f"{entry.algo} {digest}, manifest says {entry.digest}")
    return None


def deep_check(root: Path, rel: str, load: bool = False) -> Finding | None:
    """The format validator on the whole file (a torch zip: structure and every record's CRC-32, no
    torch needed; safetensors; JSON); with `load`, also torch.load a torch zip (weights_only, mmap) to
    prove it deserializes. A format without a validator gives an "unchecked" finding."""
    from mirrord.zipcheck import load_check

    try:
        fd = open_file_beneath(root, rel)  # no symlinks below the root, as everywhere else
    except OSError as exc:
        return Finding(rel, "unreadable", exc.strerror or str(exc))
    try:
        verdict = validate_fd(fd, rel)
    finally:
        os.close(fd)
    if verdict.status == OK and load and verdict.format == "torch_zip":
        loaded = load_check(root / rel)
        if not loaded.ok:
            return Finding(rel, loaded.status, loaded.detail)
    if verdict.status == OK:
        return None
    return Finding(rel, verdict.status, verdict.detail)


def verify_mirror(
    root: Path,
    patterns: Iterable[str],
    progress: Callable[[int, int, str], None] | None = None,
    deep_check: Callable[[Path, str], Finding | None] | None = None,
) -> tuple[int, list[Finding]]:
    """Check every manifest entry, then list mirror files the manifest does not know.

    Returns (files checked, findings). `deep_check` adds the format validator on every file, recorded
    or not; its "unchecked" findings (formats without a validator) are not problems (Finding.is_problem).
    """
    manifest = Manifest.load(root)
    entries = sorted(manifest.entries.values(), key=lambda e: e.path)
    total = sum(e.size for e in entries)
    done = 0
    findings: list[Finding] = []
    for entry in entries:
        if progress:
            progress(done, total, entry.path)
        finding = check_entry(root, entry)
        if finding is None and deep_check is not None:
            finding = deep_check(root, entry.path)
        if finding is not None:
            findings.append(finding)
        done += entry.size
    if progress:
        progress(total, total, "")
    snap = snapshot_tree(root, patterns)
    for rel in sorted(set(snap.files) - set(manifest.entries)):
        deep = deep_check(root, rel) if deep_check is not None else None
        if deep is not None and deep.is_problem:  # a torn or corrupt file, not only an unrecorded one
            findings.append(Finding(rel, deep.problem, f"not in the manifest, and {deep.detail}"))
        else:
            findings.append(Finding(rel, "unrecorded", "on the mirror but not in the manifest"))
    for msg in snap.errors:
        findings.append(Finding(str(root), "unreadable", msg))
    return len(entries), findings
