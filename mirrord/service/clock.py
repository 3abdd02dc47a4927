"""The daemon's two clocks, injected: tests drive time instead of waiting for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    """Wall time (timestamps, file ages, lag) and monotonic time (deadlines, settling, stalls)."""

    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


SYSTEM_CLOCK = Clock()
