"""Rollbacks: a trainer that resumes from an older step writes lower step numbers again, later in time.

Within one run, checkpoints taken in the order they were written (mtime) normally carry rising step
numbers. A step lower than one already written starts a new *branch*: the trainer went back (a
divergence, a resume from an earlier checkpoint) and everything it writes from then on supersedes the
abandoned branch, whatever the step numbers say. Checkpoints are therefore ordered by (branch, step),
not by step alone: retention keeps the newest of that order, `latest` returns its top.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from mirrord.core.model import FileState, ManifestEntry, step_of


@dataclass(frozen=True, slots=True)
class Branches:
    """The branch of every step of one run, and the rollbacks that started each new branch."""

    of: Mapping[int, int]  # step -> branch (0 for the first)
    rollbacks: tuple[tuple[int, int], ...] = ()  # (highest step before, first step after), in time order

    def key(self, step: int) -> tuple[int, int]:
        """Sort key: later branches first, then higher steps; a step not seen is on the newest branch."""
        return (self.of.get(step, self.top), step)

    @property
    def top(self) -> int:
        """How many rollbacks the run had: the index of its newest branch."""
        return len(self.rollbacks)


class Recorded(NamedTuple):
    """When mirrord first recorded a step's bytes: by the wall clock (ns, ManifestEntry.mirrored_at) and by
    the mirror's recording sequence (ManifestEntry.seq). 0: unknown."""

    at_ns: int = 0
    seq: int = 0


def recorded_of(entries: Iterable[ManifestEntry]) -> Recorded:
    """A step's Recorded from its files' entries (some: a unit's share its seq)."""
    entries = list(entries)
    return Recorded(int(max(e.mirrored_at for e in entries) * 1e9), max(e.seq for e in entries))


def branches(mtimes: Mapping[int, int], recorded: Mapping[int, Recorded] | None = None) -> Branches:
    """Branches of a run from each step's mtime (newest mtime of the step's files).

    Walking the steps in the order they were written, a step lower than the highest of the current
    branch starts a new branch. Equal mtimes are ordered by step, so coarse timestamps never invent one;
    an mtime of 0 (or before the epoch) says nothing about order: such steps stay on branch 0. A lower
    step that mirrord had recorded before the higher one was saved was saved before it, whatever its mtime
    says (`_saved_before`).
    """
    branch, high = 0, None
    recorded = recorded or {}
    of: dict[int, int] = {step: 0 for step, mtime in mtimes.items() if mtime <= 0}
    rollbacks: list[tuple[int, int]] = []
    # (mtime, step) pairs sort in C, without a key call per step (every run of a tree, at each rescan)
    for _mtime, step in sorted([(mtime, step) for step, mtime in mtimes.items() if mtime > 0]):
        if high is not None and step < high and not _saved_before(recorded, step, high, mtimes[high]):
            rollbacks.append((high, step))
            branch += 1
            high = step
        elif high is None or step > high:
            high = step
        of[step] = branch
    return Branches(of, tuple(rollbacks))


def _saved_before(recorded: Mapping[int, Recorded], low: int, high: int, high_mtime: int) -> bool:
    """mirrord recorded step `low`'s bytes before step `high` was saved: before its mtime (a clock stepped back
    on the primary, or a `touch`, moves an mtime past the time its bytes were recorded, which no save can do),
    or before `high`'s record by sequence while the clock said later: the clock was ahead when it recorded
    `low` (and when `low` was saved, on this host), and stepped back since."""
    mine, theirs = recorded.get(low, Recorded()), recorded.get(high, Recorded())
    stepped = 0 < mine.seq < theirs.seq and mine.at_ns > theirs.at_ns + _RECORDING_JITTER_NS
    return 0 < mine.at_ns < high_mtime or stepped


# A copy's sequence number and recording time are taken a moment apart, by parallel threads.
_RECORDING_JITTER_NS = 1_000_000_000


def lying_after_ns(now: float, future_skew_seconds: float) -> float:
    """The mtime (ns) beyond which a file's clock is lying: later than `now` (wall clock, seconds) plus the
    allowed clock skew. Such an mtime is no evidence of order or age. The one derivation of that line:
    retention, its guards, the daemon's rollback warnings and `latest` must split files alike."""
    return (now + future_skew_seconds) * 1e9


def run_rollbacks(
    files: Iterable[FileState], step_regex: re.Pattern[str], lie_after_ns: float = float("inf")
) -> dict[str, tuple[tuple[int, int], ...]]:
    """Every run of a listing that went back to a lower step: run -> its rollbacks (old, new step).
    An mtime past `lie_after_ns` (beyond the allowed clock skew) is a lying clock: treated as unknown."""
    mtimes: dict[str, dict[int, int]] = defaultdict(dict)
    for state in files:
        run, step = state.rel.rpartition("/")[0], step_of(state.rel, step_regex)
        if step is not None:
            steps = mtimes[run]
            mtime = 0 if state.mtime_ns > lie_after_ns else state.mtime_ns
            steps[step] = max(steps.get(step, 0), mtime)
    found = {run: branches(steps).rollbacks for run, steps in mtimes.items()}
    return {run: rollbacks for run, rollbacks in found.items() if rollbacks}
