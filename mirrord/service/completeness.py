"""The shell half of completeness on the primary: read the few small files a rule needs, then let the
pure rule (mirrord.core.units.completeness) decide."""

from __future__ import annotations

from collections.abc import Callable

from mirrord.core.layouts import Layout
from mirrord.core.model import FileState
from mirrord.core.units import MAX_READ_BYTES, Completeness, Unit, completeness, reads_needed
from mirrord.errors import UnsafePathError
from mirrord.store.volume import LocalVolume


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
