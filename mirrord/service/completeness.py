"""The shell half of completeness on the primary: read the few small files a rule needs, then let the
pure rule (mirrord.core.units.completeness) decide."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mirrord.core.contributions import Sharing, local_part
from mirrord.core.layouts import Layout
from mirrord.core.model import FileState
from mirrord.core.units import MAX_READ_BYTES, Completeness, Unit, completeness, reads_needed
from mirrord.errors import UnsafePathError
from mirrord.formats.dcpmeta import METADATA_NAME
from mirrord.store.manifest import Manifest
from mirrord.store.volume import LocalVolume

if TYPE_CHECKING:
    from mirrord.config import Config


def read_small(volume: LocalVolume, rel: str, limit: int = MAX_READ_BYTES) -> bytes | None:
    """The whole file, beneath the root and never through a symlink; None if it cannot be read or is
    larger than `limit` (no rule needs that much: such a file is not the one it expects)."""
    try:
        with volume.open_read(rel) as f:
            data = f.read(limit + 1)
    except (OSError, UnsafePathError):
        return None
    return data if len(data) <= limit else None


def judge(
    volume: LocalVolume, layout: Layout, settled: Callable[[FileState], bool] = lambda _state: True
) -> Callable[[Unit], Completeness]:
    """The completeness predicate of one listing of `volume`: each unit judged by its layout's rule."""
    def complete(unit: Unit) -> Completeness:
        reads = {rel: read_small(volume, rel) for rel in reads_needed(unit, layout)}
        return completeness(unit, layout, settled, reads)

    return complete


def judge_part(
    volume: LocalVolume, settled: Callable[[FileState], bool] = lambda _state: True
) -> Callable[[Unit], Completeness]:
    """Whether this node's share of a DCP folder written by several nodes is done (its `.metadata` read
    when it has it): mirrord.core.contributions.local_part."""
    def done(unit: Unit) -> Completeness:
        has_metadata = unit.get(METADATA_NAME) is not None
        metadata = read_small(volume, f"{unit.rel}/{METADATA_NAME}") if has_metadata else None
        return local_part(unit, settled, metadata)

    return done


def sharing_for(
    config: Config, manifest: Manifest, volume: LocalVolume, settled: Callable[[FileState], bool]
) -> Sharing | None:
    """Folder units written by several nodes (s3.units_span_nodes): this node's name, the contributions the
    manifest holds, and the judge of this node's share; None when the setting is off."""
    if not config.s3.units_span_nodes:
        return None
    from mirrord.store.s3 import node_name  # only an object-store mirror gets here

    return Sharing(node_name(config.s3.node), manifest.contributions, judge_part(volume, settled))
