"""What this process has seen with its own eyes: since when (monotonic clock) each file is unchanged.

A file's mtime comes from whichever clock wrote it (an NFS server's, a trainer's), and "now" from a
wall clock that NTP or an operator can step: their difference is not an age. Deciding that a file is
settled or old enough to delete by our own observation means a clock step can delay a decision, never
hasten it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from mirrord.core.model import FileState, Snapshot
from mirrord.core.vocabulary import Volume


class Observations:
    """(volume, rel) -> (identity, first seen unchanged). Thread-safe; `clock` is injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # volume -> rel -> (identity, first seen unchanged): per volume, so that a complete listing of one
        # replaces its map whole (forgetting what is gone) instead of sweeping every key of both.
        self._seen: dict[str, dict[str, tuple[tuple[int, int, int, int], float]]] = {}
        self._lock = threading.Lock()

    def seen_for(self, volume: str, state: FileState, now: float | None = None) -> float:
        """Seconds this file has been seen exactly as `state` (0 the first time, or after a change)."""
        now = self.clock() if now is None else now
        with self._lock:
            seen_in = self._seen.setdefault(volume, {})
            seen = seen_in.get(state.rel)
            if seen is None or seen[0] != state.identity:
                seen_in[state.rel] = (state.identity, now)
                return 0.0
            return max(0.0, now - seen[1])

    def update(self, volume: str, states: Iterable[FileState]) -> dict[tuple[str, str], float]:
        """Observe a complete listing of `volume` (forgetting files no longer in it)."""
        now = self.clock()
        result: dict[tuple[str, str], float] = {}
        listed: dict[str, tuple[tuple[int, int, int, int], float]] = {}
        # seen_for inlined under one lock: a daemon's every rescan observes every file of both sides.
        with self._lock:
            before = self._seen.get(volume, {})
            for state in states:
                rel, identity = state.rel, state.identity
                seen = before.get(rel)
                if seen is None or seen[0] != identity:
                    seen = (identity, now)
                listed[rel] = seen
                result[(volume, rel)] = max(0.0, now - seen[1])
            self._seen[volume] = listed
        return result

    def observe(self, primary: Snapshot, mirror: Snapshot) -> dict[tuple[str, str], float]:
        """Observe complete listings of both sides (mirror temp files included): what the min-age guard reads."""
        observed = self.update(Volume.PRIMARY, primary.files.values())
        observed.update(self.update(Volume.MIRROR, [*mirror.files.values(), *mirror.partials.values(),
                                                    *mirror.staging.values()]))
        return observed
