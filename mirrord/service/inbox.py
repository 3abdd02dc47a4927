"""What the daemon's main loop has to do next, and the one way to wake it.

Watcher threads post hints, worker threads ask for a prune or a rescan, signal handlers (through
set_wakeup_fd) and the supervisor write to the self-pipe: each only records and wakes; the loop acts.
"""

from __future__ import annotations

import collections
import contextlib
import selectors
import socket
import threading

from mirrord.service.watcher import Hint

# Past this many distinct hints waiting (an event storm while the loop is busy), they are all replaced by
# one rescan: events are hints, the listing is the truth, and the memory they hold stays bounded.
MAX_HINTS = 10_000
_RESCAN = Hint("", committed=False, rescan=True)


class Inbox:
    """Hints from the watcher, requests from workers, and a self-pipe that wakes the loop's select."""

    def __init__(self) -> None:
        self.hints: collections.OrderedDict[Hint, None] = collections.OrderedDict()  # waiting, each once
        self._lock = threading.Lock()
        self.rescan_asked = False  # e.g. by a hint drained during a prune pass: done when the pass ends
        self.prune_due = False  # copies finished: retention may have something to delete
        # When deletions wait only for our own observation (the min-age guard's monotonic clock), the
        # next prune pass is due when that observation matures, not at the next rescan.
        self.prune_at: float | None = None
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._r, selectors.EVENT_READ)

    @property
    def write_fd(self) -> int:
        """The self-pipe's write end (for signal.set_wakeup_fd)."""
        return self._w.fileno()

    def post(self, hint: Hint) -> None:
        """Queue a hint, unless the same one still waits, and wake the loop (called from watcher threads)."""
        with self._lock:
            if len(self.hints) >= MAX_HINTS:
                self.hints.clear()
                self.hints[_RESCAN] = None
            self.hints[hint] = None
        self.wake()

    def next_hint(self) -> Hint:
        """The oldest hint waiting, taken off the queue."""
        with self._lock:
            return self.hints.popitem(last=False)[0]

    def ask_prune(self) -> None:
        """Ask for a prune pass (called from worker threads when a copy is done)."""
        self.prune_due = True
        self.wake()

    def prune_when(self, due: float) -> None:
        """Ask for a prune pass at monotonic time `due` at the latest."""
        self.prune_at = due if self.prune_at is None else min(self.prune_at, due)

    def wake(self) -> None:
        """Make the loop's current or next wait() return at once."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._w.send(b"\0")

    def wait(self, timeout: float) -> None:
        """Sleep until woken or `timeout` seconds pass (no wait at all while hints are queued)."""
        if self._selector.select(0 if self.hints else max(0.0, timeout)):
            with contextlib.suppress(BlockingIOError):
                while self._r.recv(4096):
                    pass

    def close(self) -> None:
        """Release the self-pipe."""
        self._selector.close()
        self._r.close()
        self._w.close()
