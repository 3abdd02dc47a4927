"""The shell half of completeness on the primary: read the few small files a rule needs, then let the
pure rule (mirrord.core.units.completeness) decide."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from mirrord.core.contributions import Sharing, local_part
from mirrord.core.model import FileState, ManifestEntry
from mirrord.core.units import MAX_READ_BYTES, Completeness, Quiet, Unit, completeness, reads_needed
from mirrord.errors import UnsafePathError
from mirrord.formats.dcpmeta import METADATA_NAME
from mirrord.layouts import MEGATRON_TRACKER, Layout
from mirrord.obs.log import get_logger
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import LocalTree
from mirrord.store.staging import list_folder

if TYPE_CHECKING:
    from mirrord.config import Config


def read_small(volume: LocalTree, rel: str) -> bytes | None:
    """The whole file (a safetensors file: its first bytes, up to the end of its header), beneath the root
    and never through a symlink; None if it cannot be read or is larger than MAX_READ_BYTES (no rule needs
    that much: such a file is not the one it expects)."""
    try:
        with volume.open_read(rel) as f:
            if rel.endswith(".safetensors"):
                head = f.read(8)
                return head + f.read(min(int.from_bytes(head, "little"), MAX_READ_BYTES)) if len(head) == 8 else None
            data = f.read(MAX_READ_BYTES + 1)
    except (OSError, UnsafePathError):
        return None
    return data if len(data) <= MAX_READ_BYTES else None


def not_files(volume: LocalTree, unit: Unit) -> Completeness | None:
    """A folder unit holding a member that cannot be copied as a file (a symlink: deduplicated storage, a
    hub snapshot; a FIFO) is not whole: the mirror could only leave it out and still call the folder whole."""
    odd: list[str] = []
    with contextlib.suppress(OSError):
        list_folder(volume.root, unit.rel, Layout.is_member_name, odd)
    if not odd:
        return None
    return Completeness(
        False,
        f"{min(odd)} is a symlink or not a regular file: it cannot be copied as a file, "
        "so the folder is never whole on the mirror (store the file itself there)",
    )


def judge(
    volume: LocalTree,
    layout: Layout,
    quiet: Quiet = lambda _unit, _guess: True,
    tell: bool = False,
    recorded: Callable[[Unit], frozenset[str] | None] = lambda _unit: None,
) -> Callable[[Unit], Completeness]:
    """The completeness predicate of one listing of `volume`: each unit judged by its layout's rule. With
    `tell`, a unit that has been quiet and is still not whole (a member that is not a file, a state file
    that does not parse, a missing shard) is logged once for the listing, with why. `recorded`: the files
    of the run's previous checkpoint on the mirror (recorded_names)."""
    told: set[str] = set()

    def complete(unit: Unit) -> Completeness:
        verdict = not_files(volume, unit) if unit.kind == "folder" else None
        event = "unit.not_whole"  # (told at once)
        if verdict is None:
            reads = {rel: read_small(volume, rel) for rel in reads_needed(unit, layout)}
            expects = layout.rule == "accelerate" or layout.tag_file == MEGATRON_TRACKER  # (the ranks' files)
            verdict = completeness(unit, layout, quiet, reads, recorded(unit) if expects else None)
            event = "unit.incomplete"  # (told once the unit has been quiet)
        if tell and not verdict.complete and unit.rel not in told and (event == "unit.not_whole" or quiet(unit, False)):
            told.add(unit.rel)
            get_logger().warning(event, path=unit.rel, why=verdict.why)
        return verdict

    return complete


def recorded_names(entries: Mapping[str, ManifestEntry], layout: Layout) -> Callable[[Unit], frozenset[str] | None]:
    """The member names of the newest checkpoint of a unit's run recorded on the mirror with an earlier step
    (the files a saver writes every time: what the next one must have too); None when there is none."""

    def names(unit: Unit) -> frozenset[str] | None:
        prefix = f"{unit.run}/" if unit.run else ""
        found: dict[tuple[int, str], set[str]] = {}  # (step, folder) -> member names
        for rel in entries:
            folder, _, member = rel[len(prefix) :].partition("/")
            step = layout.step_of(folder) if rel.startswith(prefix) and member else None
            if step is not None and unit.step is not None and step < unit.step and layout.is_unit_name(folder):
                found.setdefault((step, folder), set()).add(member)
        return frozenset(found[max(found)]) if found else None

    return names


def sharing_for(
    config: Config, manifest: Manifest, volume: LocalTree, settled: Callable[[FileState], bool]
) -> Sharing | None:
    """Folder units written by several nodes (s3.units_span_nodes): this node's name, the contributions the
    manifest holds, and the judge of this node's share (local_part, its `.metadata` read when it has it);
    None when the setting is off."""
    if not config.s3.units_span_nodes:
        return None
    from mirrord.store.s3 import node_name  # only an object-store mirror gets here

    def done(unit: Unit) -> Completeness:
        has_metadata = unit.get(METADATA_NAME) is not None
        return local_part(unit, settled, read_small(volume, f"{unit.rel}/{METADATA_NAME}") if has_metadata else None)

    return Sharing(node_name(config.s3.node), manifest.contributions, done)
