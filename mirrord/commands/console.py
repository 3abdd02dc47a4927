"""A live view of the copies under way, for a person at a terminal (`mirrord sync` on a TTY).

One line per copy (path, bar, bytes done of total, rate, time left), redrawn in place a few times a
second with two ANSI sequences (cursor up, clear to the end of the screen). Log lines written through
`LiveCopies.stream` appear above the live lines. Not rich: structlog imports rich at start-up whenever
it is installed, which would have made every daemon start slower for the sake of this view.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from typing import TextIO

from mirrord.obs.sizes import human_bytes
from mirrord.service.progress import CopyProgress, ProgressBoard

REFRESH_SECONDS = 0.25
_UP_AND_CLEAR = "\x1b[{n}A\x1b[J"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA ?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"ETA {hours}:{minutes:02d}:{secs:02d}" if hours else f"ETA {minutes}:{secs:02d}"


def progress_line(p: CopyProgress, width: int = 24) -> str:
    """`run/step_9.pt [#######.........]  30%  1.2 GiB of 4.0 GiB  85.0 MiB/s  ETA 0:34`"""
    bar = ("#" * int(p.fraction * width)).ljust(width, ".")
    return (
        f"{p.path} [{bar}] {p.fraction:4.0%}  {human_bytes(p.bytes_done)} of {human_bytes(p.size)}  "
        f"{human_bytes(p.rate)}/s  {_eta(p.eta_seconds)}"
    )


class LiveCopies:
    """Draws the board's copies below everything else written to `out`; thread-safe. Also the text stream
    loggers write to (write, flush, isatty): each write lands above the live lines."""

    def __init__(self, board: ProgressBoard, out: TextIO) -> None:
        self.board = board
        self.out = out
        self._lock = threading.Lock()
        self._shown = 0  # live lines currently on the screen, just above the cursor

    def write(self, text: str = "", draw: bool = True) -> int:
        """Print `text` above the live lines, which are drawn again below it once a line is complete
        (`write()` alone redraws them after the copies changed; draw=False clears them for good)."""
        with self._lock:
            if self._shown:
                self.out.write(_UP_AND_CLEAR.format(n=self._shown))
                self._shown = 0
            self.out.write(text)
            if draw and (not text or text.endswith("\n")):
                columns = shutil.get_terminal_size().columns
                lines = [progress_line(p)[: columns - 1] for p in self.board.snapshot()]  # never wrap: count stays true
                self.out.write("".join(line + "\n" for line in lines))
                self._shown = len(lines)
            self.out.flush()
        return len(text)

    def flush(self) -> None:
        """Flush the terminal."""
        self.out.flush()

    def isatty(self) -> bool:
        """Whether the terminal is one (it is: the view is shown only on one)."""
        return self.out.isatty()


@contextlib.contextmanager
def live_copies(board: ProgressBoard, out: TextIO) -> Iterator[TextIO]:
    """Show the board's copies on `out` (a terminal) while the block runs; yields the stream for log lines."""
    live = LiveCopies(board, out)
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(REFRESH_SECONDS):
            live.write()

    thread = threading.Thread(target=refresh, name="mirrord-progress", daemon=True)
    thread.start()
    try:
        yield live  # type: ignore[misc]  # a minimal text stream: write, flush, isatty
    finally:
        stop.set()
        thread.join()
        live.write(draw=False)
