"""SIGHUP: whether a newly read config may replace the running one. Pure: two configs in, a verdict out."""

from __future__ import annotations

from typing import Any, NamedTuple

from mirrord.config import Config, risky_changes

# Keys a SIGHUP cannot change: they define what is watched, where it goes, or where we listen.
RESTART_ONLY = ("primary", "mirror", "layout", "unit", "patterns", "mirror_must_be_mountpoint", "watch.mode", "metrics")
UNSTABLE_READ = (
    "the file kept changing while it was read; write it to a temporary name and rename it into place, then reload again"
)


class Refusal(NamedTuple):
    """Why a reload is refused: the keys concerned, and what to do about it."""

    keys: list[str]
    why: str


def reload_refusal(old: Config, new: Config, stable: bool) -> Refusal | None:
    """None if `new` may replace `old`; else the keys that stop it.

    Restart-only keys are never changed by a reload. A change that makes retention delete more or
    sooner needs a stable read: a half-written file reads as defaults for the missing sections or a cut
    number, and must never make retention delete more.
    """
    old_data, new_data = old.to_toml_dict(), new.to_toml_dict()
    fixed = [k for k in RESTART_ONLY if _get(old_data, k) != _get(new_data, k)]
    if fixed:
        return Refusal(fixed, "these keys need a restart")
    risky = risky_changes(old, new)
    if risky and not stable:
        return Refusal(risky, UNSTABLE_READ)
    return None


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
