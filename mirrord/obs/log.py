"""structlog configuration: JSON lines when not on a TTY (journald, Docker), console rendering on one."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import FilteringBoundLogger, Processor

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _LossyStream:
    """A log stream whose failures never reach the caller.

    A full disk under journald's pipe, a closed stdout or an EIO must not stop a copy or kill a worker
    thread: mirroring matters more than the log line about it. Lost lines are counted.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = 0

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            self.lost += 1
            return 0

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self.lost += 1

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False


def configure(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure once at start-up; `fmt` is json | console | auto."""
    stream = stream or sys.stdout
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=stream.isatty())
        if use_console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=_LossyStream(stream)),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get_logger() -> FilteringBoundLogger:
    """mirrord's logger (a filtering bound logger once configure() ran; events are snake_case names)."""
    logger: FilteringBoundLogger = structlog.get_logger("mirrord")
    return logger
