"""Signal handlers that only record: installed before anything slow, so that a SIGHUP or SIGTERM
that arrives while the daemon is still starting (reading its config, taking the lock, loading the
manifest) is acted on by the main loop instead of killing the process with the default action."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalFlags:
    """Counts stop signals and remembers a reload request. NO LOGGING in the handlers: the loop acts."""

    def __init__(self) -> None:
        self.stop_requests = 0
        self.reload_requested = False
        self._previous: dict[int, Any] = {}

    def install(self) -> SignalFlags:
        """Take over SIGTERM, SIGINT and SIGHUP (from the main thread); idempotent."""
        for signum in (*STOP_SIGNALS, signal.SIGHUP):
            previous = signal.signal(signum, self._record)
            self._previous.setdefault(signum, previous)
        return self

    def wake_through(self, fd: int) -> None:
        """Also wake a select() on `fd` when a signal arrives (the daemon's self-pipe)."""
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)

    def restore(self) -> None:
        """Give the signals back to their previous handlers and stop waking the loop's fd."""
        signal.set_wakeup_fd(-1)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload_requested = True
        else:
            self.stop_requests += 1
