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


@dataclass(frozen=True)
class Finding:
    path: str
    problem: str  # missing | size_mismatch | hash_mismatch | unreadable | unrecorded | <deep status>
    detail: str = ""


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
    """Structural check of a torch.save zip (every record's CRC-32, no torch needed); with `load`,
    also torch.load it (weights_only, mmap) to prove it deserializes."""
    from mirrord.zipcheck import check_torch_zip_fd, load_check

    try:
        fd = open_file_beneath(root, rel)  # no symlinks below the root, as everywhere else
    except OSError as exc:
        return Finding(rel, "unreadable", exc.strerror or str(exc))
    try:
        result = check_torch_zip_fd(fd)
    finally:
        os.close(fd)
    if result.status == "ok" and load:
        result = load_check(root / rel)
    if result.status == "ok":
        return None
    return Finding(rel, result.status, result.detail)


def verify_mirror(
    root: Path,
    patterns: Iterable[str],
    progress: Callable[[int, int, str], None] | None = None,
    deep_check: Callable[[Path, str], Finding | None] | None = None,
) -> tuple[int, list[Finding]]:
    """Check every manifest entry, then list mirror files the manifest does not know.

    Returns (files checked, findings). `deep_check` adds a per-file structural check (torch zip CRCs).
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
        findings.append(Finding(rel, "unrecorded", "on the mirror but not in the manifest"))
    for msg in snap.errors:
        findings.append(Finding(str(root), "unreadable", msg))
    return len(entries), findings
