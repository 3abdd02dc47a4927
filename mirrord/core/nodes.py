"""A node's entry is its own: nodes sharing one S3 prefix never alias one another's names.

Every node's local rank 0 may save `run/step_5.pt`. An entry's size and mtime describe the source of the
node that recorded it (`ManifestEntry.node`), never another node's file, so this node plans against its
own entries only. Another node's entry counts for this node once this node's source was hashed and found
to hold the same bytes (`Matched`, kept by the engine): no upload then, whatever the mtimes. A source with
other bytes is a conflict: reported, never uploaded over the other node's object (each node would
replace the other's in turn forever), and never taken as mirrored (retention keeps it on the primary).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, MutableMapping
from dataclasses import replace

from mirrord.core.model import ManifestEntry

# path -> this node's source as last hashed (size, mtime_ns, digest), where another node recorded the path
Matched = MutableMapping[str, tuple[int, int, str]]


def foreign(entry: ManifestEntry | None, node: str) -> bool:
    """Whether `entry` was recorded by a node other than `node` (never on a mirror without nodes)."""
    return entry is not None and bool(node) and bool(entry.node) and entry.node != node


def own_view(
    entries: Mapping[str, ManifestEntry], node: str, matched: Matched, ours: Container[str]
) -> Mapping[str, ManifestEntry]:
    """The manifest as this node plans its copies from: another node's entry of a name this node's primary
    also holds (`ours`) only where this node's source, as last hashed, holds the same bytes (shown with
    this node's mtime), else left out; every other entry as recorded. Drops what `matched` holds of names
    no longer shared (bounded state)."""
    if not node:
        return entries
    theirs = {rel: e for rel, e in entries.items() if rel in ours and foreign(e, node)}
    for rel in [r for r in matched if r not in theirs]:
        del matched[rel]
    if not theirs:
        return entries
    view = dict(entries)
    for rel, entry in theirs.items():
        seen = matched.get(rel)
        if seen is None or seen[2] != entry.digest:
            del view[rel]
            continue
        view[rel] = replace(entry, size=seen[0], source_mtime_ns=seen[1], mirror_mtime_ns=entry.stored_mtime_ns)
    return view
