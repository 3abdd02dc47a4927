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

from mirrord.core.model import FileState, step_of


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


def branches(mtimes: Mapping[int, int], recorded: Mapping[int, int] | None = None) -> Branches:
    """Branches of a run from each step's mtime (newest mtime of the step's files).

    Walking the steps in the order they were written, a step lower than the highest of the current
    branch starts a new branch. Equal mtimes are ordered by step, so coarse timestamps never invent one;
    an mtime of 0 (or before the epoch) says nothing about order: such steps stay on branch 0. A lower
    step that mirrord had recorded before the higher one was saved (`recorded`: step -> ns, when mirrord first
    recorded those bytes, ManifestEntry.mirrored_at) was saved before it, whatever its mtime says: a clock
    stepped back, or a `touch`, moves an mtime past the time its bytes were recorded, which no save can do.
    """
    branch, high = 0, None
    recorded = recorded or {}
    of: dict[int, int] = {step: 0 for step, mtime in mtimes.items() if mtime <= 0}
    rollbacks: list[tuple[int, int]] = []
    # (mtime, step) pairs sort in C, without a key call per step (every run of a tree, at each rescan)
    for _mtime, step in sorted([(mtime, step) for step, mtime in mtimes.items() if mtime > 0]):
        recorded_before = high is not None and 0 < recorded.get(step, 0) < mtimes[high]
        if high is not None and step < high and not recorded_before:
            rollbacks.append((high, step))
            branch += 1
            high = step
        elif high is None or step > high:
            high = step
        of[step] = branch
    return Branches(of, tuple(rollbacks))


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
