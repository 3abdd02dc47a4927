"""Waiting for a condition with a deadline: the only way the tests wait (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.05,
    context: Callable[[], str] | None = None,
) -> Any:
    """Poll `predicate` until it returns a truthy value (returned), or fail naming `what` at the deadline.

    `context`, if given, is called on failure and its text appended (a log tail, a service state).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f":\n{context()}" if context is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{extra}")
        time.sleep(interval)
