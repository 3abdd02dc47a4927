"""What the tests check of a mirrored folder unit against the manifest (no part of the daemon needs it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mirrord.core.model import ManifestEntry, entry_passed
from mirrord.core.units import Unit


def unit_verified(unit: Unit, manifest: Mapping[str, ManifestEntry]) -> bool:
    """A unit on the mirror that the manifest vouches for whole: every file recorded with its size and a
    passing verdict, and as many files as were recorded under the folder (none missing)."""
    if not unit.files or any(
        (e := manifest.get(f.rel)) is None or e.size != f.size or not entry_passed(e) for f in unit.files
    ):
        return False
    return unit.kind != "folder" or sum(rel.startswith(unit.rel + "/") for rel in manifest) == len(unit.files)


def stepless(units: Iterable[Unit]) -> list[Unit]:
    """Checkpoints with no step in their name: retention can never prune them (naming_warnings warns)."""
    return [u for u in units if u.role == "checkpoint" and u.step is None]
