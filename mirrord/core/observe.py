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
        self._seen: dict[tuple[str, str], tuple[tuple[int, int, int, int], float]] = {}
        self._lock = threading.Lock()

    def seen_for(self, volume: str, state: FileState, now: float | None = None) -> float:
        """Seconds this file has been seen exactly as `state` (0 the first time, or after a change)."""
        now = self.clock() if now is None else now
        key = (volume, state.rel)
        with self._lock:
            seen = self._seen.get(key)
            if seen is None or seen[0] != state.identity:
                self._seen[key] = (state.identity, now)
                return 0.0
            return max(0.0, now - seen[1])

    def update(self, volume: str, states: Iterable[FileState]) -> dict[tuple[str, str], float]:
        """Observe a complete listing of `volume` (forgetting files no longer in it)."""
        now = self.clock()
        states = list(states)
        result = {(volume, s.rel): self.seen_for(volume, s, now) for s in states}
        with self._lock:
            for key in [k for k in self._seen if k[0] == volume and k not in result]:
                del self._seen[key]
        return result

    def observe(self, primary: Snapshot, mirror: Snapshot) -> dict[tuple[str, str], float]:
        """Observe complete listings of both sides (mirror temp files included): what the min-age guard reads."""
        observed = self.update(Volume.PRIMARY, primary.files.values())
        observed.update(self.update(Volume.MIRROR, [*mirror.files.values(), *mirror.partials.values(),
                                                    *mirror.staging.values()]))
        return observed
