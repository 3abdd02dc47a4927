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
from mirrord.core.retention import Sightings
from mirrord.vocabulary import Volume


class _Seen:
    """One volume's observation: each file as last seen (the listing's own record: no memory of its own), and
    since when it is unchanged, held compactly: `first` has the time for the files first seen after
    `origin`; every other file has been seen unchanged since `origin` (at rest, nearly all of them).
    `states` may be the listing's own map (not `owned`): copied before it is ever changed here."""

    __slots__ = ("first", "origin", "owned", "states")

    def __init__(
        self, states: Mapping[str, FileState], first: dict[str, float], origin: float, owned: bool = True
    ) -> None:
        self.states, self.first, self.origin, self.owned = states, first, origin, owned

    def put(self, state: FileState, since: float) -> None:
        """`state` seen anew at `since` (the time first: a reader of an update's Ages sees the file younger,
        never older)."""
        self.first[state.rel] = since
        if not self.owned:
            self.states, self.owned = dict(self.states), True
        self.states[state.rel] = state  # type: ignore[index]  # (owned: a dict of ours)

    def since(self, rel: str) -> float:
        """Since when `rel` (listed) has been seen unchanged."""
        return self.first.get(rel, self.origin)


class Observations:
    """(volume, rel) -> (identity, first seen unchanged). Thread-safe; `clock` is injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # volume -> what it was seen as: per volume, so that a complete listing of one replaces its record
        # whole (forgetting what is gone) instead of sweeping every key of both. The states, not their
        # identities: a rescan lists an unchanged file with the same record (mirrord.store.scan), which `is`
        # tells at once, and the listing holds them anyway.
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()
        self.sightings = Sightings()  # follow mode's evidence of the trainer's rotations, as the last plan left it

    def seen_for(self, volume: str, state: FileState, now: float | None = None) -> float:
        """Seconds this file has been seen exactly as `state` (0 the first time, or after a change)."""
        now = self.clock() if now is None else now
        with self._lock:
            seen = self._seen.get(volume)
            if seen is None:
                seen = self._seen[volume] = _Seen({}, {}, now)
            before = seen.states.get(state.rel)
            if before is None or before.identity != state.identity:
                seen.put(state, now)
                return 0.0
            return max(0.0, now - seen.since(state.rel))

    def update(self, volume: str, states: Iterable[FileState] | Mapping[str, FileState]) -> Ages:
        """Observe a complete listing of `volume` (forgetting files no longer in it); how long each has been
        seen unchanged, as of now. Given as a map of rel -> record (a listing's files, which nobody changes
        afterwards), that very map is kept, not a copy: at 1,000,000 files a copy is 40 MB per side."""
        now = self.clock()
        shared = isinstance(states, Mapping)
        listed: Mapping[str, FileState] = states if isinstance(states, Mapping) else {s.rel: s for s in states}
        first: dict[str, float] = {}
        # seen_for inlined under one lock: a daemon's every rescan observes every file of both sides.
        with self._lock:
            before = self._seen.get(volume)
            if before is None:
                seen = _Seen(listed, first, now, owned=not shared)
            else:
                get = before.states.get
                for rel, state in listed.items():
                    was = get(rel)
                    if was is None or (was is not state and was.identity != state.identity):
                        first[rel] = now  # new or changed: seen since now
                for rel, since in before.first.items():  # the others keep their time, as the file stays
                    if rel not in first and rel in listed:
                        first[rel] = since
                seen = _Seen(listed, first, before.origin, owned=not shared)
            self._seen[volume] = seen
        return Ages({volume: (seen, now)})

    def observe(self, primary: Snapshot, mirror: Snapshot) -> Mapping[tuple[str, str], float]:
        """Observe complete listings of both sides (mirror temp files included): what the min-age guard reads."""
        ages = self.update(Volume.PRIMARY, primary.files)
        listed = (
            {**mirror.files, **mirror.partials, **mirror.staging, **mirror.versions}
            if mirror.partials or mirror.staging or mirror.versions
            else mirror.files
        )
        return Ages({**ages.volumes, **self.update(Volume.MIRROR, listed).volumes})


class Ages(Mapping[tuple[str, str], float]):
    """(volume, rel) -> seconds seen unchanged as of one observation, for the files it listed; computed when
    asked (the guards ask about deletion candidates only, a rescan lists every file of both sides).

    It reads the observation's own record, which only a later seen_for of a changed file touches: that makes
    the file younger, so it can delay a deletion, never hasten it."""

    __slots__ = ("volumes",)

    def __init__(self, volumes: dict[str, tuple[_Seen, float]]) -> None:
        self.volumes = volumes  # volume -> (its observation, as of when)

    def get(self, key: tuple[str, str], default: float | None = None) -> float | None:  # type: ignore[override]
        """The age of (volume, rel), or `default` when that observation did not list it."""
        volume, rel = key
        seen, now = self.volumes.get(volume, (None, 0.0))
        if seen is None or rel not in seen.states:
            return default
        return max(0.0, now - seen.since(rel))

    def __getitem__(self, key: tuple[str, str]) -> float:
        age = self.get(key)
        if age is None:
            raise KeyError(key)
        return age

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((volume, rel) for volume, (seen, _now) in self.volumes.items() for rel in seen.states)

    def __len__(self) -> int:
        return sum(len(seen.states) for seen, _now in self.volumes.values())
