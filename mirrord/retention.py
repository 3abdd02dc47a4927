"""Pure retention planning: which checkpoints to delete on each side, which to keep and why.

    snapshots of both sides + manifest + in-flight set + now + policy  ->  PrunePlan

Checkpoints are grouped by run (their folder relative to the root) and ordered by the step in their
file name. A step is *verified* when the mirror holds all its files, each recorded in the manifest
with a matching size, and every primary file of the step is the one that was mirrored. Per run:

* the kept set is what any retention policy keeps ("keep if any keeps", so combining policies can
  only keep more): the `keep_last` highest verified steps, and with `keep_every = N` every step that
  is a multiple of N;
* candidates are the steps below the lowest `keep_last` step, on the mirror, and on the primary
  when `prune.primary = true`. Anything at or above it (not yet mirrored, in flight, unverified) is
  never a candidate, on either side. A run with no verified step has no candidates at all;
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

from mirrord.config import PruneConfig
from mirrord.guards import GuardContext, veto
from mirrord.model import FileState, ManifestEntry, Snapshot, step_of
from mirrord.plan import why_copy

PRIMARY, MIRROR = "primary", "mirror"

# Why a file is kept.
KEEP_LAST = "keep_last"
KEEP_EVERY = "keep_every"
NEWER_THAN_KEPT = "newer_than_kept"
NO_STEP = "no_step"
UNVERIFIED = "unverified"

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
    """The `n` highest verified steps."""

    n: int
    why: str = KEEP_LAST

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]:
        return frozenset(sorted(verified)[-self.n:])


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
    why: str  # keep_last | keep_every | newer_than_kept | no_step | unverified


@dataclass(frozen=True, slots=True)
class Skipped:
    volume: str
    rel: str
    step: int | None
    reason: str  # a guard's reason (mirrord.guards.REASONS)
    size: int = 0


@dataclass(frozen=True)
class PrunePlan:
    deletions: tuple[Deletion, ...] = ()
    kept: tuple[Kept, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()  # (reason, detail); non-empty means delete nothing
    newest: frozenset[str] = frozenset()  # files of each run's newest verified step
    floors: Mapping[str, int] = field(default_factory=dict)  # run -> lowest keep_last step
    preserved: Mapping[str, frozenset[int]] = field(default_factory=dict)  # run -> steps policies keep

    def retired(self, run: str, step: int | None) -> bool:
        """A step below its run's kept window that no policy keeps: pruned, so not worth copying again."""
        floor = self.floors.get(run)
        return (
            step is not None and floor is not None and step < floor
            and step not in self.preserved.get(run, frozenset())
        )


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
) -> PrunePlan:
    """The prune plan for one cycle. Pure: the same inputs give the same plan.

    `roots` maps "primary"/"mirror" to their root paths (for the path guard); `mirror_is_mount` is
    None unless `mirror_must_be_mountpoint` asks for the check.
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
    newest: set[str] = set()
    floors: dict[str, int] = {}
    keeps: dict[str, frozenset[int]] = {}
    for run, by_step in runs.items():
        verified = {
            step for step, files in by_step.items()
            if _step_verified(files[PRIMARY], files[MIRROR], manifest, mirror.files)
        }
        steps = sorted(by_step)
        keep = preserved(policies, steps, verified)
        keeps[run] = frozenset(keep)
        window = KeepLast(policy.keep_last).preserve(steps, verified)
        # Only a full window has a floor: with fewer than keep_last verified steps, every step is kept
        # (an older step whose mirror copy is damaged is repaired, not retired).
        floor = min(window) if len(window) >= policy.keep_last else None
        if floor is not None:
            floors[run] = floor
        if verified:
            top = by_step[max(verified)]
            newest.update(s.rel for s in top[PRIMARY] + top[MIRROR])
        for step in steps:
            for side in (PRIMARY, MIRROR):
                for state in by_step[step][side]:
                    if step in keep:
                        kept.append(Kept(side, state.rel, step, keep[step]))
                    elif floor is None or step >= floor:
                        why = NEWER_THAN_KEPT if not window or step > max(window) else UNVERIFIED
                        kept.append(Kept(side, state.rel, step, why))
                    elif side == PRIMARY and not policy.primary:
                        continue  # the primary is not ours to prune
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
    )
    deletions: list[Deletion] = []
    skipped: list[Skipped] = []
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
        floors=floors,
        preserved=keeps,
    )


def deletion_order(d: Deletion) -> tuple[bool, int, str, bool]:
    """Orphan temp files first (pure waste), then the oldest steps; mirror before primary."""
    return (d.kind != ORPHAN_PART, d.step if d.step is not None else -1, d.rel, d.volume != MIRROR)


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
        if entry is None or entry.size != dst.size:
            return False
    return all(why_copy(src, manifest.get(src.rel), mirror_all.get(src.rel)) is None for src in primary_files)
