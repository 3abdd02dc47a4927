"""Folder units written by several nodes: each node's part, and when the parts make the whole unit.

A torch.distributed.checkpoint folder saved by N ranks on N nodes is spread over N primaries: each node
holds its ranks' `*.distcp` files, and one node (rank 0's) the `.metadata` that lists them all. With
`s3.units_span_nodes`, each node's mirrord uploads the files it has under their final keys and records
them as a *contribution* to the unit (per node, beside the manifest's entries, never as entries); the
unit becomes complete when the contributions together hold every file the `.metadata` lists, each
with the bytes it needs: then, in the same conditional write of the manifest, every file of every
contribution becomes an entry (the unit's commit point) and the contributions are dropped.

    local_part(unit, settled, metadata)          is this node's share of the unit done?     (pure)
    covered(parts)                               do the parts make the whole unit?            (pure)
    contribute(entries, contributions, unit, p)  the manifest after adding a part              (pure)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from mirrord.core.model import FileState, ManifestEntry
from mirrord.core.units import Completeness, Unit, dcp_needs, lacking
from mirrord.formats.dcpmeta import DATA_SUFFIX, METADATA_NAME


@dataclass(frozen=True)
class Contribution:
    """What one node uploaded of a folder unit: its files' entries (size, hash, verdict, as any entry),
    and what the `.metadata` it uploaded lists (member -> bytes it needs; None: it had no `.metadata`)."""

    node: str
    files: Mapping[str, ManifestEntry]  # by root-relative path
    needs: Mapping[str, int] | None
    at: float  # wall clock when it was recorded


# unit path -> node -> its contribution
Contributions = Mapping[str, Mapping[str, Contribution]]


def local_part(unit: Unit, settled: Callable[[FileState], bool], metadata: bytes | None) -> Completeness:
    """Whether this node holds all it will ever hold of a DCP folder whose other files are on other
    nodes: every file has settled, and each is one the `.metadata` lists (with the bytes it needs),
    or, on a node without the `.metadata`, each is a `*.distcp` data file. `metadata`: the bytes of
    the folder's `.metadata` (None: absent or unreadable)."""
    unsettled = [f for f in unit.files if not settled(f)]
    if unsettled:
        return Completeness(False, f"still being written: {unit.member(unsettled[0].rel)}")
    if unit.get(METADATA_NAME) is None:
        strays = [unit.member(f.rel) for f in unit.files if not f.rel.endswith(DATA_SUFFIX)]
        if strays:
            return Completeness(
                False, f"{strays[0]} is no {DATA_SUFFIX} data file, and no {METADATA_NAME} says what it is"
            )
        return Completeness(True, f"{len(unit.files)} data file(s) settled; {METADATA_NAME} is on another node")
    needs = dcp_needs(metadata)
    if isinstance(needs, Completeness):
        return needs
    sizes = {m: f.size for f in unit.files if (m := unit.member(f.rel)) != METADATA_NAME}
    unlisted = sorted(set(sizes) - set(needs))
    if unlisted:
        return Completeness(False, f"{unlisted[0]} is not listed by {METADATA_NAME}")
    return lacking({m: needs[m] for m in sizes}, sizes, "") or Completeness(
        True, f"{len(unit.files)} file(s) settled, each listed by {METADATA_NAME}"
    )


def _union(parts: Mapping[str, Contribution]) -> tuple[dict[str, ManifestEntry], str | None]:
    """Every file of the parts, and a conflict (two nodes uploaded the same path with other bytes) if any."""
    files: dict[str, ManifestEntry] = {}
    for node in sorted(parts):
        for rel, entry in parts[node].files.items():
            if rel in files and not _same(files[rel], entry):
                return files, f"{rel} was uploaded by two nodes with other bytes"
            files[rel] = entry
    return files, None


def covered(unit: str, parts: Mapping[str, Contribution]) -> Completeness:
    """Whether the parts make the whole unit: a part holds the `.metadata`, and the parts together hold
    every file it lists with at least the bytes it needs (as DCP's own rule on one primary)."""
    files, conflict = _union(parts)
    if conflict is not None:
        return Completeness(False, conflict)
    metadata = f"{unit}/{METADATA_NAME}"
    needs = next((p.needs for p in parts.values() if p.needs is not None and metadata in p.files), None)
    if needs is None:
        return Completeness(False, f"no node has uploaded {METADATA_NAME} yet")
    sizes = {rel.removeprefix(f"{unit}/"): entry.size for rel, entry in files.items()}
    short = lacking(needs, sizes, "lists {}, which no node has uploaded yet")
    if short is not None:
        return short
    nodes = ", ".join(sorted(parts))
    return Completeness(True, f"{METADATA_NAME} and its {len(needs)} file(s) uploaded by {nodes}")


@dataclass(frozen=True)
class Merged:
    """The manifest after one contribution: entries to put and remove, the contributions now, and
    whether the unit is complete (then `puts` is every file of it and its contributions are gone)."""

    puts: tuple[ManifestEntry, ...]
    removes: tuple[str, ...]
    contributions: dict[str, dict[str, Contribution]]
    verdict: Completeness


def contribute(
    entries: Mapping[str, ManifestEntry],
    contributions: Contributions,
    unit: str,
    part: Contribution,
    stored: Mapping[str, int] | None = None,
) -> Merged:
    """Add (or replace) `part.node`'s contribution to `unit`. When the parts now cover the unit, every
    file of theirs becomes an entry and any older entry under the unit that none of them has is
    removed, in the same change: the unit is recorded whole or not at all.

    `stored` (path -> size of the objects under the unit now): another node's part whose files are no
    longer all there with their sizes (retention deleted a stale part, the folder was saved again) is
    dropped, never counted: that node uploads its share again. A part whose files the entries already
    record with the same bytes changes nothing (the unit was completed by another node meanwhile)."""
    merged = {u: dict(nodes) for u, nodes in contributions.items()}
    if part.files and all(_same(entries.get(rel), entry) for rel, entry in part.files.items()):
        others = merged.get(unit, {})
        others.pop(part.node, None)
        if not others:
            merged.pop(unit, None)
        return Merged((), (), merged, Completeness(True, "already recorded whole"))
    parts = merged.setdefault(unit, {})
    if stored is not None:
        for node in [
            n
            for n, p in parts.items()
            if n != part.node and any(stored.get(rel) != e.size for rel, e in p.files.items())
        ]:
            del parts[node]
    parts[part.node] = part
    verdict = covered(unit, parts)
    if not verdict.complete:
        return Merged((), (), merged, verdict)
    files, _conflict = _union(parts)
    prefix = unit + "/"
    removes = tuple(sorted(rel for rel in entries if rel.startswith(prefix) and rel not in files))
    del merged[unit]
    # Each node recorded its own share's count: the unit's files are all of theirs (ManifestEntry.members).
    whole = tuple(replace(files[rel], members=len(files)) for rel in sorted(files))
    return Merged(whole, removes, merged, verdict)


def _same(recorded: ManifestEntry | None, entry: ManifestEntry) -> bool:
    """The same bytes: size and content hash."""
    return recorded is not None and (recorded.size, recorded.algo, recorded.digest) == (
        entry.size,
        entry.algo,
        entry.digest,
    )


@dataclass(frozen=True)
class Sharing:
    """What the copy planner needs for folder units several nodes write: this node's name, the recorded
    contributions, and the judge of this node's local share (local_part, with the shell's reads)."""

    node: str
    contributions: Contributions
    part_done: Callable[[Unit], Completeness]

    def plan(self, unit: Unit, mirror_files: Mapping[str, FileState]) -> Literal["in_sync", "part", "wait"]:
        """For a unit not whole on this primary: its share recorded and on the mirror (in_sync), to be
        uploaded as this node's part (part), or not done here yet (wait)."""
        if unit.kind != "folder" or unit.role != "checkpoint":
            return "wait"
        # In sync: the recorded part is exactly this node's files as they are now (same paths, sizes and
        # mtimes), each still on the mirror with its size.
        part = self.contributions.get(unit.rel, {}).get(self.node)
        if (
            part is not None
            and set(part.files) == set(unit.paths)
            and all(
                (part.files[f.rel].size, part.files[f.rel].source_mtime_ns) == (f.size, f.mtime_ns)
                and (stored := mirror_files.get(f.rel)) is not None
                and stored.size == f.size
                for f in unit.files
            )
        ):
            return "in_sync"
        return "part" if self.part_done(unit).complete else "wait"
