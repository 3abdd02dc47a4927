"""`mirrord verify`: recheck every mirrored artifact against the manifest (size, then content hash).

Everything is read through the storage seam (mirrord.store.mirror): the same checks run on a local
mirror and on an object store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mirrord.formats.verdicts import OK
from mirrord.layouts import Layout
from mirrord.store.mirror import ReadableStore, fd_path, random_access_fd
from mirrord.store.resume import PART, Finding, check_entry, validate_key


def deep_check(store: ReadableStore, rel: str, load: bool = False) -> Finding | None:
    """The format validator on the whole file, chosen by name then content (a torch zip: structure and
    every record's CRC-32, no torch needed; safetensors; JSON; a DCP .metadata with every file it
    references, a .distcp against its .metadata); with `load`, also torch.load a torch zip (weights_only,
    mmap) to prove it deserializes. A format without a validator gives an "unchecked" finding."""
    from mirrord.formats.zipcheck import load_check

    verdict = validate_key(store, rel)
    if verdict.status != OK:
        return Finding(rel, verdict.status, verdict.detail)
    if not (load and verdict.format == "torch_zip"):
        return None
    try:
        with store.open_read(rel) as stream, random_access_fd(stream) as fd:
            loaded = load_check(fd_path(fd))
    except OSError as exc:
        return Finding(rel, "unreadable", exc.strerror or str(exc))
    return None if loaded.ok else Finding(rel, loaded.status, loaded.detail)


def verify_mirror(
    store: ReadableStore,
    patterns: Iterable[str],
    progress: Callable[[int, int, str], None] | None = None,
    deep_check: Callable[[ReadableStore, str], Finding | None] | None = None,
    layout: Layout | None = None,
) -> tuple[int, list[Finding]]:
    """Check every manifest entry, then list mirror files the manifest does not know.

    Returns (files checked, findings). `deep_check` adds the format validator on every file, recorded
    or not; its "unchecked" findings (formats without a validator) are not problems (Finding.is_problem).
    A listing error is a finding whose path is store.describe(). With a folder `layout`, the mirror is
    listed as the daemon lists it (every file of a unit folder, `.metadata` too).
    """
    manifest = store.load_manifest()
    entries = sorted(manifest.entries.values(), key=lambda e: e.path)
    total = sum(e.size for e in entries)
    done = 0
    findings: list[Finding] = []
    for entry in entries:
        if progress:
            progress(done, total, entry.path)
        finding = check_entry(store, entry)
        if finding is None and deep_check is not None:
            finding = deep_check(store, entry.path)
        if finding is not None:
            findings.append(finding)
        done += entry.size
    if progress:
        progress(total, total, "")
    snap = store.snapshot(patterns, layout)
    parts = {
        rel: (node, entry)
        for unit in manifest.contributions.values()
        for node, part in unit.items()
        for rel, entry in part.files.items()
    }
    for rel in sorted(set(snap.files) - set(manifest.entries)):
        if rel in parts:
            node, entry = parts[rel]
            bad = check_entry(store, entry)
            findings.append(
                Finding(rel, "unrecorded", f"part uploaded by node {node}, and {bad.problem}: {bad.detail}")
                if bad is not None
                else Finding(
                    rel,
                    PART,
                    f"uploaded by node {node}: part of a unit that is not complete "
                    "yet (waiting for other nodes' shares)",
                )
            )
            continue
        deep = deep_check(store, rel) if deep_check is not None else None
        if deep is not None and deep.is_problem:  # a torn or corrupt file, not only an unrecorded one
            findings.append(Finding(rel, deep.problem, f"not in the manifest, and {deep.detail}"))
        else:
            findings.append(Finding(rel, "unrecorded", "on the mirror but not in the manifest"))
    findings += [Finding(store.describe(), "unreadable", msg) for msg in snap.errors]
    return len(entries), findings
