"""Guards: pure vetoes on one deletion. Each returns a named reason to keep the file, or None.

A guard can only keep more, never delete more. The reasons are stable words that reach logs and the
`mirrord_prune_skipped_total{reason}` metric. The planner applies them to every candidate, and the
executor applies them again to a fresh stat just before unlinking, because the world may have changed.
"""

from __future__ import annotations

import functools
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath

from mirrord.core.branches import lying_after_ns
from mirrord.core.model import FileState
from mirrord.errors import UnsafePathError
from mirrord.paths import TEMP_SUFFIX, split_rel
from mirrord.vocabulary import Veto

NS = 1_000_000_000
REASONS = tuple(Veto)


@dataclass(frozen=True, slots=True)
class GuardContext:
    """Everything a guard may look at besides the file itself; `now` is passed in, never read."""

    now: float
    min_age_seconds: float
    future_skew_seconds: float
    in_flight: frozenset[str] = frozenset()
    newest: frozenset[str] = frozenset()
    roots: Mapping[str, PurePath] | None = None
    # (volume, rel) -> seconds this process has seen the file unchanged (monotonic); None: not checked.
    observed: Mapping[tuple[str, str], float] | None = None


Guard = Callable[[str, FileState, GuardContext], Veto | None]


@functools.lru_cache(maxsize=64)
def _nested_prefix(own: PurePath, other: PurePath) -> str | None:
    """`other` relative to `own` plus '/', when `other` lies strictly inside `own`; else None.
    Roots are few and fixed while files are many, hence the cache."""
    if other == own or not other.is_relative_to(own):
        return None
    return other.relative_to(own).as_posix() + "/"


def outside_roots(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """Not a regular file, or a path that does not stay below its own root (and out of the other root).

    Snapshots never list symlinks, and the executor walks without following them; this catches a
    listing that would send a deletion somewhere else: '..', an absolute path, a mirror nested in the
    primary.
    """
    if not state.is_regular and not (stat.S_ISDIR(state.mode) and state.rel.endswith(TEMP_SUFFIX)):
        return Veto.NOT_REGULAR  # (a dead NAME.part/ staging folder is swept as a whole)
    try:
        parts = split_rel(state.rel)
    except UnsafePathError:
        return Veto.NOT_REGULAR
    if "/".join(parts) != state.rel:
        return Veto.NOT_REGULAR  # not the canonical form a listing produces ('a//b', 'a/./b', 'a/')
    if ctx.roots is not None:
        own = ctx.roots.get(volume)
        if own is None:
            return Veto.NOT_REGULAR
        # split_rel refused '', '.', '..' and absolute paths, so own/rel lies strictly below own;
        # what is left is a root nested in ours, compared as strings (pathlib per file is slow).
        for name, other in ctx.roots.items():
            prefix = None if name == volume else _nested_prefix(own, other)
            if prefix is not None and (state.rel + "/").startswith(prefix):
                return Veto.NOT_REGULAR
    return None


def in_flight(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """Queued or being copied in this process; NAME.part counts as NAME, and a file of a folder unit
    counts as its folder (a job names the folder)."""
    rel = state.rel.removesuffix(TEMP_SUFFIX)
    if state.rel in ctx.in_flight or rel in ctx.in_flight:
        return Veto.IN_FLIGHT
    while "/" in rel and ctx.in_flight:
        rel = rel.rsplit("/", 1)[0]
        if rel in ctx.in_flight or rel.removesuffix(TEMP_SUFFIX) in ctx.in_flight:
            return Veto.IN_FLIGHT
    return None


def zero_mtime(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """An mtime of 0 (or before the epoch) means the filesystem does not know: unknown is not old."""
    return Veto.ZERO_MTIME if state.mtime_ns <= 0 else None


def future_mtime(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """An mtime beyond the allowed clock skew is a lying clock or filesystem, not a sign of age."""
    return Veto.FUTURE_MTIME if state.mtime_ns > lying_after_ns(ctx.now, ctx.future_skew_seconds) else None


def recent_mtime(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """Modified within min_age_seconds (or slightly in the future): it may still be written or copied."""
    return Veto.RECENT_MTIME if state.mtime_ns > (ctx.now - ctx.min_age_seconds) * NS else None


def recently_seen(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """Not seen unchanged for min_age_seconds on the monotonic clock: a wall clock stepped forward
    (NTP, a lagging NFS server) makes an mtime look old, never an observation."""
    if ctx.observed is None or ctx.min_age_seconds <= 0:
        return None
    return Veto.RECENTLY_SEEN if ctx.observed.get((volume, state.rel), 0.0) < ctx.min_age_seconds else None


def newest(volume: str, state: FileState, ctx: GuardContext) -> Veto | None:
    """Part of the newest verified checkpoint of its run: the one a resume needs."""
    return Veto.NEWEST if state.rel in ctx.newest else None


# Order decides which reason is reported when several apply: the most specific first.
GUARDS: tuple[Guard, ...] = (outside_roots, in_flight, zero_mtime, future_mtime, recent_mtime, recently_seen, newest)


def veto(volume: str, state: FileState, ctx: GuardContext, guards: tuple[Guard, ...] = GUARDS) -> Veto | None:
    """The first guard's reason to keep `state` on `volume`, or None if every guard allows deleting it."""
    return next((reason for guard in guards if (reason := guard(volume, state, ctx)) is not None), None)
