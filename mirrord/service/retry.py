"""When a failed copy is tried again: a few times after a growing, jittered backoff, then (in the
daemon) at the next rescan, which plans every file the mirror still lacks whatever the error was."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mirrord.config import Config


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts a transient failure gets, and how long to wait between them."""

    max_attempts: int = 5
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    # Seconds until a periodic reconcile plans a file that failed for good again (None: nothing will).
    rescan_seconds: float | None = None

    @classmethod
    def from_config(cls, config: Config, rescans: bool = False) -> RetryPolicy:
        """The policy config.copy describes; `rescans` when a daemon's periodic reconcile follows."""
        return cls(
            config.copy.max_attempts,
            config.copy.retry_backoff_seconds,
            config.copy.retry_backoff_max_seconds,
            config.watch.rescan_interval_seconds if rescans else None,
        )

    def retries(self, attempt: int) -> bool:
        """Whether a transient failure of attempt `attempt` (1-based) is tried again."""
        return attempt < self.max_attempts

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Exponential backoff with jitter after the `attempt`-th failure: in [d/2, d], d = base*2^(n-1),
        d capped at backoff_max_seconds (the jitter keeps retries of a burst from marching in step)."""
        delay = min(self.backoff_max_seconds, self.backoff_seconds * 2.0 ** (attempt - 1))
        return float(delay * (0.5 + rand() / 2))
