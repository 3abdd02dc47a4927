"""A manifest entry held in memory as one bytes object, made back into a ManifestEntry when asked for.

A ManifestEntry with its digest string and its numbers is ~370 bytes in objects; packed it is one
~130-byte bytes object. At 1,000,000 entries that is 240 MB less, what keeps a reconcile under 1 GB.
Anything that does not pack back to exactly the same entry (a digest that is not lowercase hex, a
number beyond 64 bits, an unknown verdict) stays a ManifestEntry: packing never changes an entry.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from typing import Any

from mirrord.core.model import ManifestEntry
from mirrord.store.hashing import ALGORITHMS

# The fixed fields of a packed entry, before its raw digest; mirrord.store.companion writes and reads its
# records in this same layout, so the two encodings are one and these names are shared:
# size, source_mtime_ns, step, mirrored_at, mirror_mtime_ns, mirror_ino, mirror_ctime_ns, algo, verdict, flags
RECORD_LAYOUT = struct.Struct("<qqqdqqqBBB")
NO_STEP, NO_MIRROR_MTIME = 1, 2  # flag bits: step, mirror_mtime_ns is None (its field holds 0)
VERDICTS: tuple[str | None, ...] = (None, "ok", "unchecked")  # by their code in the verdict field
_VERDICT_CODE = {v: i for i, v in enumerate(VERDICTS)}
_ALGO_CODE = {a: i for i, a in enumerate(ALGORITHMS)}

Held = bytes | ManifestEntry  # what a Manifest keeps per path


def pack(e: ManifestEntry) -> Held:
    """`e` as one bytes object, or `e` itself when it would not come back identical."""
    packed = pack_fields(e.size, e.algo, e.digest, e.source_mtime_ns, e.step, e.mirrored_at, e.mirror_mtime_ns,
                         e.validation, e.mirror_ino, e.mirror_ctime_ns)
    return e if packed is None else packed


def pack_fields(size: int, algo: str, digest: str, source_mtime_ns: int, step: int | None, mirrored_at: float,
                mirror_mtime_ns: int | None, validation: str | None, mirror_ino: int, mirror_ctime_ns: int
                ) -> bytes | None:
    """A ManifestEntry's fields but its path, packed; None when they would not come back identical."""
    try:
        raw = bytes.fromhex(digest)
        if raw.hex() != digest:  # upper case or spaces: it would come back as another string
            return None
        return RECORD_LAYOUT.pack(
            size, source_mtime_ns, 0 if step is None else step, mirrored_at,
            0 if mirror_mtime_ns is None else mirror_mtime_ns, mirror_ino, mirror_ctime_ns,
            _ALGO_CODE[algo], _VERDICT_CODE[validation],
            (NO_STEP if step is None else 0) | (NO_MIRROR_MTIME if mirror_mtime_ns is None else 0),
        ) + raw
    except (struct.error, KeyError, ValueError, TypeError):  # beyond 64 bits, an unknown verdict ...
        return None


def unpack(path: str, held: Held) -> ManifestEntry:
    """The entry of `path` as it was packed."""
    if type(held) is not bytes:
        return held  # type: ignore[return-value]
    size, mtime, step, at, mirror_mtime, ino, ctime, algo, verdict, flags = RECORD_LAYOUT.unpack_from(held)
    return ManifestEntry(
        path, size, ALGORITHMS[algo], held[RECORD_LAYOUT.size:].hex(), mtime, None if flags & NO_STEP else step, at,
        None if flags & NO_MIRROR_MTIME else mirror_mtime, VERDICTS[verdict], ino, ctime)


class Entries(Mapping[str, ManifestEntry]):
    """A read-only mapping of path -> ManifestEntry over held (packed or not) entries; each entry is made
    when it is asked for, so a consumer that walks them keeps one at a time."""

    __slots__ = ("_held",)

    def __init__(self, held: dict[str, Held]) -> None:
        self._held = held  # owned: the caller hands over a dict nobody else changes

    def __getitem__(self, path: str) -> ManifestEntry:
        return unpack(path, self._held[path])

    def get(self, path: str, default: Any = None) -> Any:
        """The entry of `path`, or `default`."""
        held = self._held.get(path)
        return default if held is None else unpack(path, held)

    def __contains__(self, path: object) -> bool:
        return path in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __repr__(self) -> str:
        return f"Entries({dict(self.items())!r})"
