"""Pure retention planning: which checkpoints to delete on each side, which to keep and why.

    snapshots of both sides + manifest + in-flight set + now + policy  ->  PrunePlan

Checkpoints are grouped by run (their folder relative to the root) and ordered by (branch, step): a
rollback (a lower step written after a higher one, see mirrord.branches) starts a newer branch. A step
is *verified* when the mirror holds all its files, each recorded in the manifest with a matching size
and a passing validator verdict, and every primary file of the step is the one that was mirrored. Per run:

* the kept set is what any retention policy keeps ("keep if any keeps", so combining policies can
  only keep more): the `keep_last` newest verified steps, and with `keep_every = N` every step that
  is a multiple of N;
* the window is the `keep_last` newest steps *present* (on either side, verified or not); steps below
  it are *retired*: not worth copying (first run on an existing tree, or an unverified newest step,
  never causes copy-then-delete churn);
* a retired step is a candidate only when every step of the window is verified: a torn or unfinished
  newest step keeps every older one (a step retired itself, never copied, does not). Candidates are
  on the mirror, and on the primary when
  `prune.primary = true` - a primary file only if the mirror holds a verified copy of that exact
  file (reason `unmirrored` otherwise), whatever its step;
* files whose name carries no step are never pruned;
* orphan NAME.part files on the mirror (left by a dead process) are candidates too.

Every candidate then passes the guards (mirrord.guards); a veto moves it to `skipped` with its
reason. A view that may be partial (a listing error) or a mirror that looks unmounted refuses the
whole plan: it deletes nothing.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Protocol

from mirrord.branches import Branches, branches
from mirrord.config import PruneConfig
from mirrord.guards import UNMIRRORED, GuardContext, veto
from mirrord.model import FileState, ManifestEntry, Snapshot, step_of
from mirrord.plan import why_copy
from mirrord.validators import PASSING

PRIMARY, MIRROR = "primary", "mirror"

# Why a file is kept.
KEEP_LAST = "keep_last"
KEEP_EVERY = "keep_every"
NEWER_THAN_KEPT = "newer_than_kept"
NO_STEP = "no_step"
UNVERIFIED = "unverified"
NEWER_UNVERIFIED = "newer_unverified"  # retired, but a newer step is not verified yet: still the fallback

# Why a whole plan is refused.
PARTIAL_VIEW = "partial_view"
MIRROR_UNMOUNTED = "mirror_unmounted"

STEP, ORPHAN_PART = "step", "orphan_part"


def describe_policy(policy: PruneConfig) -> str:
    """The retention in force, in one line for a person (start-up banner and log)."""
    if not policy.enabled:
        return "off (prune.enabled = false): nothing is ever deleted"
    sides = "on the mirror and the primary" if policy.primary else "on the mirror only (prune.primary = false)"
    text = f"keep_last={policy.keep_last} verified steps per run"
    if policy.keep_every:
        text += f", plus every step that is a multiple of keep_every={policy.keep_every}"
    text += f"; older steps are deleted {sides}; nothing younger than min_age_seconds={policy.min_age_seconds:g}"
    text += " is deleted"
    return text + ("; prune.dry_run = true: deletions are only logged" if policy.dry_run else "")


class Policy(Protocol):
    """A retention rule: the steps of one run it wants to keep. Policies never delete."""

    @property
    def why(self) -> str: ...

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]: ...


@dataclass(frozen=True)
class KeepLast:
    """The `n` newest verified steps (`steps` come oldest first: by branch, then step)."""

    n: int
    why: str = KEEP_LAST

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]:
        return frozenset([s for s in steps if s in verified][-self.n:])


@dataclass(frozen=True)
class KeepEvery:
    """Milestones: every step that is a multiple of `every` (step 0 included), verified or not."""

    every: int
    why: str = KEEP_EVERY

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]:
        return frozenset(s for s in steps if s % self.every == 0)


def preserved(policies: Sequence[Policy], steps: Sequence[int], verified: AbstractSet[int]) -> dict[int, str]:
    """Keep if any policy keeps: step -> the first policy's reason."""
    kept: dict[int, str] = {}
    for policy in policies:
        for step in policy.preserve(steps, verified):
            kept.setdefault(step, policy.why)
    return kept


def policies_for(config: PruneConfig) -> tuple[Policy, ...]:
    policies: list[Policy] = [KeepLast(config.keep_last)]
    if config.keep_every is not None:
        policies.append(KeepEvery(config.keep_every))
    return tuple(policies)


@dataclass(frozen=True, slots=True)
class Deletion:
    volume: str
    state: FileState
    step: int | None
    kind: str = STEP  # step | orphan_part
    entry: ManifestEntry | None = None  # the manifest record to drop with it (mirror side)

    @property
    def rel(self) -> str:
        return self.state.rel


@dataclass(frozen=True, slots=True)
class Kept:
    volume: str
    rel: str
    step: int | None
    why: str  # keep_last | keep_every | newer_than_kept | no_step | unverified | newer_unverified


@dataclass(frozen=True, slots=True)
class Skipped:
    volume: str
    rel: str
    step: int | None
    reason: str  # a guard's reason (mirrord.guards.REASONS)
    size: int = 0


@dataclass(frozen=True)
class Window:
    """Where one run's retention window starts, to tell the copy planner which steps are retired."""

    floor: tuple[int, int]  # (branch, step) of the oldest step in the window
    branches: Branches
    newest_mtime_ns: int  # newest file of the run: anything newer is new, never retired


@dataclass(frozen=True)
class PrunePlan:
    deletions: tuple[Deletion, ...] = ()
    kept: tuple[Kept, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()  # (reason, detail); non-empty means delete nothing
    newest: frozenset[str] = frozenset()  # files of each run's newest verified step
    windows: Mapping[str, Window] = field(default_factory=dict)  # runs with more than keep_last steps
    preserved: Mapping[str, frozenset[int]] = field(default_factory=dict)  # run -> steps policies keep
    rollbacks: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def retired(self, run: str, step: int | None, mtime_ns: int | None = None) -> bool:
        """A step below its run's window (the keep_last newest steps present) that no policy keeps:
        not worth copying. A file newer than every file the plan saw in its run is never retired (a
        rollback's first step is low but new)."""
        window = self.windows.get(run)
        if step is None or window is None or step in self.preserved.get(run, frozenset()):
            return False
        if mtime_ns is not None and mtime_ns > window.newest_mtime_ns:
            return False
        return window.branches.key(step) < window.floor


def mirror_unmounted(
    mirror: Snapshot, manifest: Mapping[str, ManifestEntry], is_mount: bool | None = None
) -> str | None:
    """Why the mirror root looks like an unmounted mount point, or None.

    `is_mount` is None when `mirror_must_be_mountpoint` is off (nothing to check).
    """
    if is_mount is False:
        return "the mirror is not a mount point (mirror_must_be_mountpoint = true)"
    # A listing that failed (EMFILE, EIO ...) is a partial view, refused as such: never "unmounted".
    if manifest and not mirror.files and not mirror.errors:
        return f"the mirror is empty but the manifest lists {len(manifest)} file(s): is it mounted?"
    return None


def plan_prune(
    primary: Snapshot,
    mirror: Snapshot,
    manifest: Mapping[str, ManifestEntry],
    in_flight: frozenset[str],
    now: float,
    policy: PruneConfig,
    step_regex: re.Pattern[str],
    roots: Mapping[str, PurePath] | None = None,
    mirror_is_mount: bool | None = None,
    observed: Mapping[tuple[str, str], float] | None = None,
    invalid: AbstractSet[str] = frozenset(),
    space_pressure: bool = False,
) -> PrunePlan:
    """The prune plan for one cycle. Pure: the same inputs give the same plan.

    `roots` maps "primary"/"mirror" to their root paths (for the path guard); `mirror_is_mount` is
    None unless `mirror_must_be_mountpoint` asks for the check; `observed` maps (volume, rel) to how
    long this process has seen the file unchanged (monotonic), None to skip that guard; `invalid` are
    primary files that failed their format validator as they are now: they do not count as present for
    the window (a torn newest step must not retire the good step before it), yet, being unverified,
    they keep every older step. With `space_pressure` (the mirror cannot take the next copy) a retired
    step may go once keep_last newer steps are verified, even if others are not: otherwise a full mirror
    could never make room for the copies that would verify them.
    """
    refused: list[tuple[str, str]] = []
    for side, snap in ((PRIMARY, primary), (MIRROR, mirror)):
        for error in snap.errors:
            refused.append((PARTIAL_VIEW, f"{side} listing incomplete: {error}"))
    unmounted = mirror_unmounted(mirror, manifest, mirror_is_mount)
    if unmounted is not None:
        refused.append((MIRROR_UNMOUNTED, unmounted))

    sides = {PRIMARY: primary.files, MIRROR: mirror.files}
    # run -> step -> side -> files
    runs: dict[str, dict[int, dict[str, list[FileState]]]] = defaultdict(
        lambda: defaultdict(lambda: {PRIMARY: [], MIRROR: []})
    )
    kept: list[Kept] = []
    for side, files in sides.items():
        for state in files.values():
            step = step_of(state.rel, step_regex)
            if step is None:
                kept.append(Kept(side, state.rel, None, NO_STEP))
            else:
                runs[state.run][step][side].append(state)

    policies = policies_for(policy)
    candidates: list[Deletion] = []
    skipped: list[Skipped] = []
    newest: set[str] = set()
    windows: dict[str, Window] = {}
    keeps: dict[str, frozenset[int]] = {}
    rollbacks: dict[str, tuple[tuple[int, int], ...]] = {}
    for run, by_step in runs.items():
        # When the trainer wrote each step: the primary's word, else the mirror's (it keeps the source mtime).
        mtimes = {step: max(s.mtime_ns for s in files[PRIMARY] or files[MIRROR]) for step, files in by_step.items()}
        # An mtime beyond the allowed skew is a lying clock: it says nothing about order (as 0 does).
        lie = (now + policy.future_skew_seconds) * 1e9
        mtimes = {step: 0 if mtime > lie else mtime for step, mtime in mtimes.items()}
        run_branches = branches(mtimes)
        if run_branches.rollbacks:
            rollbacks[run] = run_branches.rollbacks
        order = sorted(by_step, key=run_branches.key)  # oldest first
        verified = {
            step for step, files in by_step.items()
            if _step_verified(files[PRIMARY], files[MIRROR], manifest, mirror.files)
        }
        keep = preserved(policies, order, verified)
        keeps[run] = frozenset(keep)
        kept_window = [s for s in order if s in verified][-policy.keep_last:]
        # Retired: below the keep_last newest steps present. Deletable: retired, not kept by a policy,
        # and the window verified (see below).
        present = [s for s in order
                   if by_step[s][MIRROR] or any(f.rel not in invalid for f in by_step[s][PRIMARY])]
        floor = run_branches.key(present[-policy.keep_last]) if len(present) > policy.keep_last else None
        if floor is not None:
            windows[run] = Window(floor, run_branches, max(mtimes.values()))
        if kept_window:
            top = by_step[kept_window[-1]]
            newest.update(s.rel for s in top[PRIMARY] + top[MIRROR])
        # The steps that would replace a retired one are the window: all must be verified first (a
        # torn or unfinished newest step keeps every older one). Under space pressure, keep_last
        # verified newer steps are enough.
        window_verified = all(s in verified for s in present[-policy.keep_last:])
        verified_above = 0
        deletable: set[int] = set()
        for step in reversed(order):
            enough = window_verified or (space_pressure and verified_above >= policy.keep_last)
            if floor is not None and run_branches.key(step) < floor and enough and step not in keep:
                deletable.add(step)
            verified_above += step in verified
        for step in order:
            for side in (PRIMARY, MIRROR):
                for state in by_step[step][side]:
                    if step in keep:
                        kept.append(Kept(side, state.rel, step, keep[step]))
                    elif floor is None or run_branches.key(step) >= floor:
                        newer = not kept_window or run_branches.key(step) > run_branches.key(kept_window[-1])
                        kept.append(Kept(side, state.rel, step, NEWER_THAN_KEPT if newer else UNVERIFIED))
                    elif step not in deletable:
                        kept.append(Kept(side, state.rel, step, NEWER_UNVERIFIED))
                    elif side == PRIMARY and not policy.primary:
                        continue  # the primary is not ours to prune
                    elif side == PRIMARY and not exact_copy(state, manifest, mirror.files):
                        skipped.append(Skipped(side, state.rel, step, UNMIRRORED, state.size))
                    else:
                        entry = manifest.get(state.rel) if side == MIRROR else None
                        candidates.append(Deletion(side, state, step, STEP, entry))
    for state in mirror.partials.values():
        candidates.append(Deletion(MIRROR, state, None, ORPHAN_PART))

    ctx = GuardContext(
        now=now,
        min_age_seconds=policy.min_age_seconds,
        future_skew_seconds=policy.future_skew_seconds,
        in_flight=in_flight,
        newest=frozenset(newest),
        roots=roots,
        observed=observed,
    )
    deletions: list[Deletion] = []
    for cand in candidates:
        reason = veto(cand.volume, cand.state, ctx)
        if reason is None:
            deletions.append(cand)
        else:
            skipped.append(Skipped(cand.volume, cand.rel, cand.step, reason, cand.state.size))
    deletions.sort(key=deletion_order)
    return PrunePlan(
        deletions=() if refused else tuple(deletions),
        kept=tuple(sorted(kept, key=lambda k: (k.rel, k.volume))),
        skipped=tuple(sorted(skipped, key=lambda s: (s.rel, s.volume))),
        refused=tuple(refused),
        newest=frozenset(newest),
        windows=windows,
        preserved=keeps,
        rollbacks=rollbacks,
    )


def deletion_order(d: Deletion) -> tuple[bool, int, str, bool]:
    """Orphan temp files first (pure waste), then the oldest steps; primary before mirror, because a
    primary file may only go while its verified mirror copy is still there."""
    return (d.kind != ORPHAN_PART, d.step if d.step is not None else -1, d.rel, d.volume != PRIMARY)


def exact_copy(src: FileState, manifest: Mapping[str, ManifestEntry], mirror_files: Mapping[str, FileState]) -> bool:
    """The mirror holds a verified copy of exactly this primary file: recorded from a source of this
    size and mtime (so with this content hash), passed its validator, and present with that size."""
    entry = manifest.get(src.rel)
    return (
        entry is not None and entry_passed(entry)
        and why_copy(src, entry, mirror_files.get(src.rel)) is None
    )


def entry_passed(entry: ManifestEntry) -> bool:
    """Recorded with a passing validator verdict (entries from before validation existed count)."""
    return entry.validation is None or entry.validation in PASSING


def _step_verified(
    primary_files: list[FileState],
    mirror_files: list[FileState],
    manifest: Mapping[str, ManifestEntry],
    mirror_all: Mapping[str, FileState],
) -> bool:
    """All of a step's files are on the mirror, recorded with a matching size, and current."""
    if not mirror_files:
        return False
    for dst in mirror_files:
        entry = manifest.get(dst.rel)
        if entry is None or entry.size != dst.size or not entry_passed(entry):
            return False
    return all(why_copy(src, manifest.get(src.rel), mirror_all.get(src.rel)) is None for src in primary_files)
