"""structlog configuration: JSON lines when not on a TTY (journald, Docker), console rendering on one.

structlog is imported when the first logger is asked for, not before: importing it pulls in rich and
asyncio (a third of `mirrord latest`'s start-up), and a read-only command that logs nothing (latest,
status) must not pay for that. configure() records its choice and applies it then (at once, when
structlog is already loaded), so every logger ever handed out renders as the last configure() said.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from structlog.typing import FilteringBoundLogger

# The values of logging.DEBUG ... logging.ERROR (this module does not import logging for them).
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


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


# What the last configure() chose, not yet given to structlog: (console?, colors?, level, stream).
_pending: tuple[bool, bool, int, _LossyStream] | None = None


def configure(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure once at start-up; `fmt` is json | console | auto. The stream's terminal test is made
    now; structlog is set up now if it is loaded, else when get_logger() first loads it."""
    global _pending
    stream = stream or sys.stdout
    tty = stream.isatty()
    _pending = (fmt == "console" or (fmt == "auto" and tty), tty, LEVELS[level], _LossyStream(stream))
    if "structlog" in sys.modules:
        _apply()


def _apply() -> None:
    """Hand the pending configuration to structlog (importing it)."""
    global _pending
    import structlog

    if _pending is None:
        return
    use_console, colors, level, stream = _pending
    _pending = None
    renderer = (
        structlog.dev.ConsoleRenderer(colors=colors)
        if use_console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _plain_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def _plain_values(_logger: object, _name: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """Enum members as their values, in dicts and lists too: a console shows `skipped={'recent_mtime': 4}`,
    not `<Veto.RECENT_MTIME: 'recent_mtime'>`."""
    return {key: _plain(value) for key, value in event.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def get_logger() -> FilteringBoundLogger:
    """mirrord's logger (a filtering bound logger once configure() ran; events are snake_case names)."""
    _apply()
    import structlog

    logger: FilteringBoundLogger = structlog.get_logger("mirrord")
    return logger
