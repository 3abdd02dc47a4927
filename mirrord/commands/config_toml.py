"""The effective configuration as TOML a person can paste into a file, each value commented with its origin.

Pure: plain data in, text out. `tomllib.loads(render(data))` gives `data` back, minus unset (None) keys,
which TOML cannot spell and which are written as comments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

HEADER = "# mirrord: the effective configuration; the comment after each value says where it came from."


def render(data: Mapping[str, Any], origin: Callable[[str], str] = lambda _key: "") -> str:
    """Top-level keys first, then one [table] per nested mapping, in the order of `data`."""
    lines = [HEADER]
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    lines += [_line(key, value, origin(key)) for key, value in data.items() if key not in tables]
    for table, values in tables.items():
        lines += ["", f"[{table}]", *(_line(key, value, origin(f"{table}.{key}")) for key, value in values.items())]
    return "\n".join(lines) + "\n"


def _line(key: str, value: Any, origin: str) -> str:
    comment = f"  # {origin}" if origin else ""
    if value is None:
        return f"# {key} = (not set){comment}"
    return f"{key} = {value_to_toml(value)}{comment}"


def value_to_toml(value: Any) -> str:
    """A TOML literal for a config value: string, bool, int, float or a list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # TOML spells inf, -inf and nan as Python does
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_to_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}: {value!r}")


def _string(value: str) -> str:
    # A literal string reads best for regexes (step_pattern = 'step_(\d+)'): no escaping at all.
    if "\\" in value and "'" not in value and all(c >= " " and c != "\x7f" for c in value):
        return f"'{value}'"
    # JSON's escapes (\" \\ \n \t \uXXXX ...) are all valid in a TOML basic string; DEL is not allowed raw.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
