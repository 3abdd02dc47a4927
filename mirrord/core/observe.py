"""What this process has seen with its own eyes: since when (monotonic clock) each file is unchanged.

A file's mtime comes from whichever clock wrote it (an NFS server's, a trainer's), and "now" from a
wall clock that NTP or an operator can step: their difference is not an age. Deciding that a file is
settled or old enough to delete by our own observation means a clock step can delay a decision, never
hasten it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from mirrord.core.model import FileState, Snapshot
from mirrord.core.vocabulary import Volume

_Seen = tuple[FileState, float]  # a file as first seen with its identity, and when (monotonic)


class Observations:
    """(volume, rel) -> (identity, first seen unchanged). Thread-safe; `clock` is injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # volume -> rel -> (state, first seen with its identity): per volume, so that a complete listing of
        # one replaces its map whole (forgetting what is gone) instead of sweeping every key of both. The
        # state, not a tuple of its identity: a rescan lists an unchanged file with the same record
        # (mirrord.store.scan), which `is` tells at once.
        self._seen: dict[str, dict[str, _Seen]] = {}
        self._lock = threading.Lock()

    def seen_for(self, volume: str, state: FileState, now: float | None = None) -> float:
        """Seconds this file has been seen exactly as `state` (0 the first time, or after a change)."""
        now = self.clock() if now is None else now
        with self._lock:
            seen_in = self._seen.setdefault(volume, {})
            seen = seen_in.get(state.rel)
            if seen is None or seen[0].identity != state.identity:
                seen_in[state.rel] = (state, now)
                return 0.0
            return max(0.0, now - seen[1])

    def update(self, volume: str, states: Iterable[FileState]) -> Ages:
        """Observe a complete listing of `volume` (forgetting files no longer in it); how long each has been
        seen unchanged, as of now."""
        now = self.clock()
        listed: dict[str, _Seen] = {}
        # seen_for inlined under one lock: a daemon's every rescan observes every file of both sides.
        with self._lock:
            before = self._seen.get(volume, {})
            get = before.get
            for state in states:
                rel = state.rel
                seen = get(rel)
                if seen is None or (seen[0] is not state and seen[0].identity != state.identity):
                    seen = (state, now)
                listed[rel] = seen
            self._seen[volume] = listed
        return Ages(volume, listed, now)

    def observe(self, primary: Snapshot, mirror: Snapshot) -> Mapping[tuple[str, str], float]:
        """Observe complete listings of both sides (mirror temp files included): what the min-age guard reads."""
        ages = self.update(Volume.PRIMARY, primary.files.values())
        listed = [*mirror.files.values(), *mirror.partials.values(), *mirror.staging.values()]
        return ages | self.update(Volume.MIRROR, listed)


class Ages(Mapping[tuple[str, str], float]):
    """(volume, rel) -> seconds seen unchanged as of one observation, for the files it listed; computed when
    asked (the guards ask about deletion candidates only, a rescan lists every file of both sides).

    It reads the observation's own map, which only a later seen_for of a changed file touches: that makes
    the file younger, so it can delay a deletion, never hasten it."""

    __slots__ = ("_volumes",)

    def __init__(self, volume: str, listed: dict[str, _Seen], now: float) -> None:
        self._volumes = {volume: (listed, now)}

    def __or__(self, other: object) -> Ages:
        """Both observations (of different volumes) as one mapping."""
        if not isinstance(other, Ages):
            return NotImplemented
        both = Ages("", {}, 0.0)
        both._volumes = {**self._volumes, **other._volumes}
        return both

    def get(self, key: tuple[str, str], default: float | None = None) -> float | None:  # type: ignore[override]
        """The age of (volume, rel), or `default` when that observation did not list it."""
        volume, rel = key
        listed, now = self._volumes.get(volume, (None, 0.0))
        seen = None if listed is None else listed.get(rel)
        return default if seen is None else max(0.0, now - seen[1])

    def __getitem__(self, key: tuple[str, str]) -> float:
        age = self.get(key)
        if age is None:
            raise KeyError(key)
        return age

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((volume, rel) for volume, (listed, _now) in self._volumes.items() for rel in listed)

    def __len__(self) -> int:
        return sum(len(listed) for listed, _now in self._volumes.values())
