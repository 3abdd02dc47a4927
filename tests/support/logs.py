"""mirrord's JSON log events, read back as dicts (other lines, tracebacks and the like, are skipped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse_events(text: str, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
    """The JSON events in `text`, in order; only those called `name` whose fields equal `match`, if given."""
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:  # a line cut short by a kill, or not ours
            continue
        if (name is None or event.get("event") == name) and all(event.get(k) == v for k, v in match.items()):
            out.append(event)
    return out


def read_events(log: Path, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
    """parse_events over a log file; none if the file does not exist yet."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return parse_events(text, name, **match)
