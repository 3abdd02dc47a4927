"""Pure retention planning: which checkpoints to delete on each side, which to keep and why.

    snapshots of both sides + manifest + in-flight set + now + policy  ->  PrunePlan

Planned afresh from the two listings each time: nothing is carried from one plan to the next.

Checkpoints are grouped by run (their folder relative to the root) and ordered by (branch, step): a
rollback (a lower step written after a higher one, see mirrord.core.branches) starts a newer branch. When
each step was written is the primary file's mtime, else what the manifest recorded of the source when its
copy was verified: never a mirror file's current mtime (a `touch` or a backup tool changes that). A step is
*verified* when the mirror holds all its files, each exactly as recorded in the manifest (size, stored
mtime) with a passing validator verdict, and every primary file of the step is the one that was mirrored;
it is *whole* when, besides, every file is part of a folder unit its layout judged complete, was read by a
validator that said "ok", or was renamed into place by its writer ("renamed"); a format no validator reads,
written in place, is "unchecked": no evidence that it is not torn. Per run:

* the kept set is what any policy keeps ("keep if any keeps", so combining policies can only keep more):
  the `keep_last` newest verified steps, every multiple of `keep_every`, and with `keep_branch_tips` the
  newest step of every abandoned branch (a rollback, a restart from scratch into the same run), unless the
  operator forgot it (`mirrord prune --forget RUN:STEP`);
* the window is the `keep_last` newest steps present (on either side, verified or not); steps below it
  are *retired*: not worth copying. A retired step is deleted only when every step of the window is
  verified and whole: a torn or unfinished newest step, or one without evidence of wholeness, keeps every
  older one. It goes from the mirror, and with `prune.primary = true` from the primary too, whether or not
  it was ever mirrored (the window that supersedes it is on the mirror);
* a mirror file whose stat no longer matches its record is neither counted nor deleted (`unconfirmed`)
  until it is verified again;
* a run whose newest verified step is gone from the primary (the folder vanished, was wiped, is not
  mounted, is being restored) is *paused*: its mirror is never shrunk until a newer step is verified or
  the operator forgets that tip;
* a step a pointer names on the mirror (DeepSpeed's `latest` tag, Lightning's `last.ckpt`) is kept;
* files whose name carries no step are never pruned; orphan NAME.part files on the mirror are candidates.

Every candidate then passes the guards (mirrord.core.guards); a veto moves it to `skipped` with its
reason. A view that may be partial (a listing error) or a mirror that looks unmounted refuses the
whole plan: it deletes nothing.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import PurePath
from typing import TYPE_CHECKING

from mirrord.core.branches import Branches, Recorded, branches, lying_after_ns, recorded_of
from mirrord.core.guards import GuardContext, veto
from mirrord.core.model import (
    PENDING,
    PREVIOUS,
    FileState,
    ManifestEntry,
    Snapshot,
    entry_passed,
    entry_whole,
    step_of,
    versioned,
)
from mirrord.core.plan import MTIME_TOLERANCE_NS, why_copy
from mirrord.core.units import locate
from mirrord.layouts import Layout
from mirrord.vocabulary import Held, PruneRefusal, Volume

if TYPE_CHECKING:
    from mirrord.config import PruneConfig

PRIMARY, MIRROR = Volume.PRIMARY, Volume.MIRROR

# Why a file is kept.
KEEP_LAST = "keep_last"
KEEP_EVERY = "keep_every"
BRANCH_TIP = Held.BRANCH_TIP  # the newest step of an abandoned branch
POINTER = Held.POINTER  # named by a pointer (DeepSpeed `latest`, Lightning `last.ckpt`, HF's best_model_checkpoint)
FOLLOWED = "followed"  # prune.mode = "follow": the trainer keeps it on the primary
NEWER_THAN_KEPT = "newer_than_kept"
NO_STEP = "no_step"
UNVERIFIED = "unverified"
NEWER_UNVERIFIED = "newer_unverified"  # retired, but a newer step is not verified and whole yet: the fallback
UNCONFIRMED = Held.UNCONFIRMED  # a mirror file whose stat no longer matches its record: verify it again
PAUSED = Held.PAUSED  # the run's newest verified step is gone from the primary: its mirror is not shrunk
NOT_ROTATED = Held.NOT_ROTATED  # follow: gone from the primary, but no evidence the trainer rotated it out

# Why a whole plan is refused.
PARTIAL_VIEW = PruneRefusal.PARTIAL_VIEW
MIRROR_UNMOUNTED = PruneRefusal.MIRROR_UNMOUNTED

STEP, ORPHAN_PART, ORPHAN_STAGING = "step", "orphan_part", "orphan_staging"
HELD = frozenset(Held)


def describe_policy(policy: PruneConfig, follow: bool = False) -> str:
    """The retention in force, in one line for a person (start-up banner and log)."""
    if not policy.enabled:
        return "off (prune.enabled = false): nothing is ever deleted"
    if follow:
        text = (
            "follow: the mirror keeps what the trainer keeps on the primary (and what a pointer names, and the tips "
            "of abandoned branches); what the trainer evidently rotated out (its own bookkeeping says so, or this "
            "daemon saw the rotation) goes from the mirror once the trainer's newest checkpoint is verified there; "
            "what a wipe, a restore or an rm took from the primary stays (not_rotated)"
        )
    else:
        sides = "on the mirror and the primary" if policy.primary else "on the mirror only (prune.primary = false)"
        text = f"keep_last={policy.keep_last} verified steps per run"
        if policy.keep_every:
            text += f", plus every step that is a multiple of keep_every={policy.keep_every}"
        text += f"; older steps are deleted {sides}"
        if policy.primary:  # mirrord is then the trainer's rotation: its own bookkeeping still binds it
            text += (
                ", except a checkpoint the trainer's newest bookkeeping still keeps (Lightning's best_k_models "
                "and best_model_path, HF's best_model_checkpoint) or a pointer names"
            )
    text += f"; nothing younger than min_age_seconds={policy.min_age_seconds:g} is deleted"
    return text + ("; prune.dry_run = true: deletions are only logged" if policy.dry_run else "")


# A policy is a retention rule: `preserve(steps, verified, run)` are the steps it keeps of `steps` (oldest
# first, by branch then step), of which `verified` are mirrored and verified, `run` saying which branch each
# step is on; `why` is its reason word for logs and metrics. Policies never delete.
@dataclass(frozen=True)
class KeepLast:
    """The `n` newest verified steps."""

    n: int
    why: str = KEEP_LAST

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int], run: Branches | None = None) -> frozenset[int]:
        """The last `n` verified steps."""
        return frozenset([s for s in steps if s in verified][-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Milestones: every step that is a multiple of `every` (step 0 included), verified or not."""

    every: int
    why: str = KEEP_EVERY

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int], run: Branches | None = None) -> frozenset[int]:
        """Every step that is a multiple of `every`."""
        return frozenset(s for s in steps if s % self.every == 0)


@dataclass(frozen=True)
class KeepBranchTips:
    """The newest step of every abandoned branch (its newest verified one, else its newest present): after a
    rollback or a restart from scratch into the same run, the furthest the old run got may be its only copy."""

    why: str = BRANCH_TIP

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int], run: Branches | None = None) -> frozenset[int]:
        """One step per branch below the newest."""
        if run is None:
            return frozenset()
        tips: dict[int, int] = {}
        for step in steps:  # oldest first: the last one seen of a branch is its newest
            branch = run.of.get(step, run.top)
            if branch < run.top and (step in verified or tips.get(branch) not in verified):
                tips[branch] = step
        return frozenset(tips.values())


Policy = KeepLast | KeepEvery | KeepBranchTips


def preserved(
    policies: Sequence[Policy], steps: Sequence[int], verified: AbstractSet[int], run: Branches | None = None
) -> dict[int, str]:
    """Keep if any policy keeps: step -> the first policy's reason."""
    kept: dict[int, str] = {}
    for policy in policies:
        for step in policy.preserve(steps, verified, run):
            kept.setdefault(step, policy.why)
    return kept


def policies_for(config: PruneConfig) -> tuple[Policy, ...]:
    """The retention policies the prune config asks for."""
    policies: list[Policy] = [KeepLast(config.keep_last)]
    if config.keep_every is not None:
        policies.append(KeepEvery(config.keep_every))
    if config.keep_branch_tips:
        policies.append(KeepBranchTips())
    return tuple(policies)


@dataclass(frozen=True, slots=True)
class Deletion:
    """One file retention will delete, on one volume (re-checked by stat just before)."""

    volume: str
    state: FileState
    step: int | None
    kind: str = STEP  # step | orphan_part | orphan_staging (a dead NAME.part/ folder)
    unit: str = ""  # the folder unit it belongs to: deleted with all the unit's files, or not at all
    # (The executor drops a mirrored step's manifest record with it, read afresh from the manifest.)

    @property
    def rel(self) -> str:
        """The file's path relative to its root."""
        return self.state.rel


@dataclass(frozen=True, slots=True)
class Kept:
    """A file retention keeps, and the policy or rule that keeps it."""

    volume: str
    rel: str
    step: int | None
    why: str  # a policy's reason, or newer_than_kept | no_step | unverified | newer_unverified | unconfirmed | paused


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file retention would delete but a guard vetoed, with the guard's reason."""

    volume: str
    rel: str
    step: int | None
    reason: str  # a guard's reason (mirrord.core.guards.REASONS)
    size: int = 0


@dataclass(frozen=True)
class Window:
    """Where one run's retention window starts, to tell the copy planner which steps are retired."""

    floor: tuple[int, int]  # (branch, step) of the oldest step in the window
    branches: Branches
    newest_mtime_ns: int  # newest file of the run: anything newer is new, never retired


@dataclass(frozen=True)
class PrunePlan:
    """A retention pass: deletions, what is kept and why, vetoes, or a refusal to delete anything."""

    deletions: tuple[Deletion, ...] = ()
    kept: tuple[Kept, ...] = ()  # by (path, volume)
    skipped: tuple[Skipped, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()  # (reason, detail); non-empty means delete nothing
    newest: frozenset[str] = frozenset()  # files of each run's newest verified step
    windows: Mapping[str, Window] = field(default_factory=dict)  # runs with more than keep_last steps
    preserved: Mapping[str, frozenset[int]] = field(default_factory=dict)  # run -> steps policies keep
    rollbacks: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # The rollbacks the primary's own files show (what the daemon warns about). None when not worked out
    # here (folder layouts group by unit, run_rollbacks by file).
    primary_rollbacks: Mapping[str, tuple[tuple[int, int], ...]] | None = None
    paused: Mapping[str, int] = field(default_factory=dict)  # run -> its newest verified step, gone from the primary
    branch_tips: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # run -> abandoned branches' tips kept
    guards: GuardContext | None = None  # what the candidates were vetted with (the executor re-uses it)
    held: Mapping[str, int] = field(default_factory=dict)  # mirror files kept beyond the policy, by Held reason
    sightings: Sightings | None = None  # follow: the request's, with what this plan saw (None: not follow)
    unrotated: tuple[tuple[str, int | str], ...] = ()  # follow: (run, step or path) kept for lack of evidence

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

    def retirement(self) -> PrunePlan:
        """This plan as `retired` reads it, and nothing else: what a daemon judges its partial listings
        (watch hints) by until its next complete one."""
        # (a run without a window retires nothing: its preserved steps are never read)
        return PrunePlan(
            refused=self.refused,
            windows=self.windows,
            preserved={run: steps for run, steps in self.preserved.items() if run in self.windows},
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
        return f"the mirror is empty but its manifest lists {len(manifest)} file(s): is it mounted?"
    return None


@dataclass(frozen=True)
class Sightings:
    """Follow mode's evidence that the trainer rotated a checkpoint out, as this process saw the primary (kept
    across passes by mirrord.core.observe): the checkpoints, (run, step) or (run, path) for a file without a
    step, seen there with a verified mirror copy; per run, the most the primary held at once (the trainer's K);
    `since`: records with a higher seq were copied from the primary by this process (None: it saw nothing)."""

    seen: frozenset[tuple[str, int | str]] = frozenset()
    most: Mapping[str, int] = field(default_factory=dict)
    since: int | None = None

    def rotated(
        self,
        run: str,
        key: int | str,
        entries: Sequence[ManifestEntry | None],
        newer: int,
        most: int,
        limit: float | None,
    ) -> bool:
        """The evidence that the trainer rotated the checkpoint out: `newer` checkpoints of its own (or pinned)
        reach its own rule's `limit` (PruneRequest.keeps), else the `most` the primary was seen holding at once,
        this process having seen the checkpoint there (listed, or its files copied from there)."""
        if limit is not None:
            return newer >= limit
        return newer >= most and (
            (run, key) in self.seen
            or (self.since is not None and any(e is not None and e.seq > self.since for e in entries))
        )


NO_SIGHTINGS = Sightings()


@dataclass(frozen=True)
class PruneRequest:
    """Everything one retention plan depends on besides the two listings and the manifest.

    `roots` maps "primary"/"mirror" to their root paths (for the path guard); `mirror_is_mount` is None
    unless `mirror_must_be_mountpoint` asks for the check; `observed` maps (volume, rel) to how long this
    process has seen the file unchanged (monotonic), None to skip that guard; `invalid` are primary files
    that failed their format validator as they are now: they do not count as present for the window (a
    torn newest step must not retire the good step before it), yet, being unverified, they keep every
    older step. With `space_pressure` (the mirror cannot take the next copy) a retired step may go once
    the window's size of newer steps are verified, even if others are not: otherwise a full mirror could
    never make room for the copies that would verify them. `forget`: (run, step) tips of abandoned
    branches (or of a paused run) the operator let go. `pointed`: mirror paths (files or folder units) a
    pointer on the mirror names: their steps are kept.
    """

    policy: PruneConfig
    step_regex: re.Pattern[str]
    now: float
    in_flight: frozenset[str] = frozenset()
    roots: Mapping[str, PurePath] | None = None
    mirror_is_mount: bool | None = None
    observed: Mapping[tuple[str, str], float] | None = None
    invalid: AbstractSet[str] = frozenset()
    space_pressure: bool = False
    layout: Layout | None = None  # folder layouts: a folder unit's files are one step, deleted together
    forget: frozenset[tuple[str, int]] = frozenset()
    pointed: frozenset[str] = frozenset()
    follow: bool = False  # prune.mode = "follow": keep what the trainer keeps (see _plan_run)
    sightings: Sightings = NO_SIGHTINGS  # follow: what this process saw of the primary (evidence of rotation)
    # follow: run -> how many checkpoints the trainer's own record says it keeps (HF's save_total_limit, inf: all;
    # 0: its bookkeeping names each one it keeps, Lightning's top k): what has that many newer (or pinned) went.
    keeps: Mapping[str, float] = field(default_factory=dict)

    @property
    def lie_after_ns(self) -> float:
        """An mtime beyond this (now + the allowed clock skew) is a lying clock: no evidence of order."""
        return lying_after_ns(self.now, self.policy.future_skew_seconds)

    def guards(self, newest: frozenset[str] = frozenset()) -> GuardContext:
        """The one GuardContext of this plan; the executor re-uses it with a fresh clock and in-flight set."""
        return GuardContext(
            now=self.now,
            min_age_seconds=self.policy.min_age_seconds,
            future_skew_seconds=self.policy.future_skew_seconds,
            in_flight=self.in_flight,
            newest=newest,
            roots=self.roots,
            observed=self.observed,
        )


# A step's files on each side: (primary, mirror); run -> step -> them.
_Sides = tuple[list[FileState], list[FileState]]
_Runs = dict[str, dict[int, _Sides]]
_BY_PATH = attrgetter("rel", "volume")


def plan_prune(
    primary: Snapshot, mirror: Snapshot, manifest: Mapping[str, ManifestEntry], request: PruneRequest
) -> PrunePlan:
    """The prune plan for one cycle. Pure: the same inputs give the same plan."""
    refused = _refusals(primary, mirror, manifest, request.mirror_is_mount)
    runs, kept, units = _by_run(primary, mirror, request.step_regex, request.layout)
    kept, candidates, stepless = _follow_stepless(primary, mirror, manifest, request, kept)
    plans = {run: _plan_run(run, by_step, manifest, request, units) for run, by_step in runs.items()}
    most = Counter(stepless.most) | Counter({run: p.most for run, p in plans.items()})  # (the larger of each)
    seen = stepless.seen.union(*(p.seen for p in plans.values()))
    for decided in plans.values():
        kept.extend(decided.kept)
        candidates.extend(decided.candidates)
    newest = frozenset(rel for decided in plans.values() for rel in decided.newest)
    candidates.extend(Deletion(MIRROR, state, None, ORPHAN_PART) for state in mirror.partials.values())
    candidates.extend(Deletion(MIRROR, state, None, ORPHAN_STAGING) for state in mirror.staging.values())
    candidates.extend(retired_versions(mirror, manifest))

    ctx = request.guards(newest)
    vetoes = [(cand, veto(cand.volume, cand.state, ctx)) for cand in candidates]
    # A folder unit goes whole or not at all: one vetoed file keeps all of it, for the first veto's reason.
    held = {(c.volume, c.unit): reason for c, reason in reversed(vetoes) if reason is not None and c.unit}
    skipped: list[Skipped] = []
    deletions: list[Deletion] = []
    for cand, reason in vetoes:
        reason = reason or held.get((cand.volume, cand.unit))
        if reason is None:
            deletions.append(cand)
        else:
            skipped.append(Skipped(cand.volume, cand.rel, cand.step, reason, cand.state.size))
    deletions.sort(key=deletion_order)
    # An unconfirmed copy retention would otherwise let go: kept, and counted as vetoed (by the guard that
    # would veto it, e.g. a copy whose mtime was set to 0, else as unconfirmed).
    unconfirmed_retired = [pair for decided in plans.values() for pair in decided.unconfirmed_retired]
    skipped += [
        Skipped(MIRROR, f.rel, step, veto(MIRROR, f, ctx) or UNCONFIRMED, f.size) for f, step in unconfirmed_retired
    ]
    beyond_policy = Counter(k.why for k in kept if k.volume == MIRROR and k.why in HELD)
    beyond_policy[UNCONFIRMED] += len(unconfirmed_retired)
    by_file = request.layout is None or not request.layout.folders
    return PrunePlan(
        deletions=() if refused else tuple(deletions),
        kept=tuple(sorted(kept, key=_BY_PATH)),
        skipped=tuple(sorted(skipped, key=_BY_PATH)),
        refused=tuple(refused),
        newest=newest,
        windows={run: p.window for run, p in plans.items() if p.window is not None},
        preserved={run: p.keep_steps for run, p in plans.items()},
        rollbacks={run: p.branches.rollbacks for run, p in plans.items() if p.branches.rollbacks},
        primary_rollbacks={run: p.primary_rollbacks for run, p in plans.items() if p.primary_rollbacks}
        if by_file
        else None,
        paused={run: p.paused for run, p in plans.items() if p.paused is not None},
        branch_tips={run: p.tips for run, p in plans.items() if p.tips},
        guards=ctx,
        held=beyond_policy,
        sightings=Sightings(seen, most, request.sightings.since) if request.follow else None,
        unrotated=tuple((run, step) for run, p in plans.items() for step in p.unrotated)
        + tuple((k.rel.rpartition("/")[0], k.rel) for k in kept if k.why == NOT_ROTATED and k.step is None),
    )


def retired_versions(mirror: Snapshot, manifest: Mapping[str, ManifestEntry]) -> list[Deletion]:
    """The versions kept beside a verified copy (mirrord.core.model.VERSIONS) that retention lets go: any whose
    name is no longer recorded (its step retired); a pending one once a newer copy was recorded under its
    name; a previous one once its run recorded a newer step (no resume needs it), or, without a step, once the
    copy that took its name is whole. One not recorded is kept:
    a promotion interrupted by a crash may have left the only whole copy there."""
    if not mirror.versions:
        return []
    newest: dict[str, int] = {}
    for e in manifest.values():
        if not e.role and e.step is not None:
            newest[e.run] = max(e.step, newest.get(e.run, e.step))
    retired = []
    for state in mirror.versions.values():
        version = manifest.get(state.rel)
        if version is None or version.role not in (PENDING, PREVIOUS):
            continue
        named = manifest.get(versioned(version))
        if (
            named is None
            or (version.role == PENDING and named.seq > version.seq)
            or (
                version.role == PREVIOUS
                and (entry_whole(named) if version.step is None else newest.get(named.run, -1) > version.step)
            )
        ):
            retired.append(Deletion(MIRROR, state, version.step))
    return retired


def _refusals(
    primary: Snapshot, mirror: Snapshot, manifest: Mapping[str, ManifestEntry], is_mount: bool | None
) -> list[tuple[str, str]]:
    """Why the whole plan must delete nothing: a partial listing, a mirror that looks unmounted."""
    refused: list[tuple[str, str]] = [
        (PARTIAL_VIEW, f"{side} listing incomplete: {error}")
        for side, snap in ((Volume.PRIMARY, primary), (Volume.MIRROR, mirror))
        for error in snap.errors
    ]
    unmounted = mirror_unmounted(mirror, manifest, is_mount)
    if unmounted is not None:
        refused.append((MIRROR_UNMOUNTED, unmounted))
    return refused


def _by_run(
    primary: Snapshot, mirror: Snapshot, step_regex: re.Pattern[str], layout: Layout | None
) -> tuple[_Runs, list[Kept], dict[str, str]]:
    """Stepped files grouped by run and step, per side; files without a step are kept (never pruned).
    Also file -> its folder unit (folder layouts)."""
    runs: _Runs = {}
    kept: list[Kept] = []
    units: dict[str, str] = {}
    for side, index, files in ((PRIMARY, 0, primary.files), (MIRROR, 1, mirror.files)):
        for state in files.values():
            run, step, unit = _place(state, step_regex, layout)
            if unit:
                units[state.rel] = unit
            if step is None:
                kept.append(Kept(side, state.rel, None, NO_STEP))
                continue
            runs.setdefault(run, {}).setdefault(step, ([], []))[index].append(state)
    return runs, kept, units


def _place(state: FileState, step_regex: re.Pattern[str], layout: Layout | None) -> tuple[str, int | None, str]:
    """(run, step, folder unit or '') of one listed file: by its layout, else by its own name."""
    if layout is None or not layout.folders:
        return state.run, step_of(state.rel, step_regex), ""
    place = locate(state.rel, layout)
    if place is None or place.kind != "folder":
        return state.run, None if place is None else place.step, ""
    return place.run, place.step, place.rel


@dataclass
class _RunPlan:
    branches: Branches
    window: Window | None
    keep_steps: frozenset[int]
    primary_rollbacks: tuple[tuple[int, int], ...] = ()
    paused: int | None = None
    tips: tuple[int, ...] = ()
    seen: set[tuple[str, int | str]] = field(default_factory=set)  # follow: sighted, still listed
    most: int = 0  # follow: the most checkpoints the primary was seen holding at once
    unrotated: tuple[int, ...] = ()
    unconfirmed_retired: list[tuple[FileState, int]] = field(default_factory=list)
    newest: list[str] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    candidates: list[Deletion] = field(default_factory=list)


def _written_at(step_files: _Sides, manifest: Mapping[str, ManifestEntry], lie: float) -> int:
    """When the trainer wrote a step: its primary files' mtime, else the source mtime the manifest recorded
    when the mirror copy was verified (never the mirror file's own mtime). 0: unknown (a lying clock, no
    record), which says nothing about order."""
    on_primary, on_mirror = step_files
    if on_primary:
        mtime = max(f.mtime_ns for f in on_primary)
    else:
        mtime = max((e.source_mtime_ns for f in on_mirror if (e := manifest.get(f.rel)) is not None), default=0)
    return 0 if mtime > lie else mtime


def _recorded(step_files: _Sides, manifest: Mapping[str, ManifestEntry]) -> Recorded:
    """When mirrord first recorded a step's bytes (mirrord.core.branches), if the record describes the step's
    primary files as they are now; unknown if a file is not recorded, or was saved again since."""
    on_primary, on_mirror = step_files
    entries = [manifest.get(f.rel) for f in (*on_primary, *on_mirror)]
    if any(e is None for e in entries) or any(
        f.size != e.size or abs(f.mtime_ns - e.source_mtime_ns) > MTIME_TOLERANCE_NS
        for f, e in zip(on_primary, entries, strict=False)
        if e
    ):
        return Recorded()
    return recorded_of(e for e in entries if e)


def _plan_run(
    run: str,
    by_step: dict[int, _Sides],
    manifest: Mapping[str, ManifestEntry],
    request: PruneRequest,
    units: Mapping[str, str],
) -> _RunPlan:
    """One run: its branches and window, what each policy keeps, and its deletion candidates."""
    policy, lie = request.policy, request.lie_after_ns
    n = policy.keep_last  # the window: the keep_last newest steps present
    run_branches = branches(
        {step: _written_at(sides, manifest, lie) for step, sides in by_step.items()},
        {step: _recorded(sides, manifest) for step, sides in by_step.items()},
    )
    order = sorted(by_step, key=run_branches.key)  # oldest first, by (branch, step)
    unconfirmed = {
        step
        for step, (_p, on_mirror) in by_step.items()
        if any(not _as_recorded(f, manifest.get(f.rel)) for f in on_mirror)
    }
    verified = {step for step, sides in by_step.items() if _step_verified(*sides, manifest)}  # (never unconfirmed)
    # Evidence of wholeness: a folder unit was judged complete by its layout's rule before it was mirrored;
    # a file needs a validator's ok.
    whole = {step for step in verified if all(f.rel in units or entry_whole(manifest[f.rel]) for f in by_step[step][1])}
    forgotten = {step for r, step in request.forget if r == run}
    # Follow: the trainer's choice, as its primary shows it, and the tips of the branches it abandoned (a
    # restart from scratch into the same folder is no choice to drop the old run's furthest checkpoint).
    policies = ((KeepBranchTips(),) if policy.keep_branch_tips else ()) if request.follow else policies_for(policy)
    keep = {
        step: why
        for step, why in preserved(policies, order, verified, run_branches).items()
        if not (why == BRANCH_TIP and step in forgotten)
    }
    if request.follow:
        keep |= {step: FOLLOWED for step, (on_primary, _m) in by_step.items() if on_primary}
    pinned = {  # (the trainer's best may not be mirrored yet)
        step
        for step, (on_primary, on_mirror) in by_step.items()
        if any(f.rel in request.pointed or units.get(f.rel) in request.pointed for f in (*on_primary, *on_mirror))
    }
    keep |= {step: POINTER for step in pinned if step not in keep}
    newest_verified = next((s for s in reversed(order) if s in verified), None)
    present = [s for s in order if by_step[s][1] or any(f.rel not in request.invalid for f in by_step[s][0])]
    # Follow: the window is the trainer's newest step (nothing is retired from copying).
    window = [s for s in order if by_step[s][0]][-1:] if request.follow else present[-n:]
    floor = order.index(window[0]) if len(present) > len(window) and not request.follow else None
    newest_mtime = max(f.mtime_ns for sides in by_step.values() for f in (*sides[0], *sides[1]))
    plan = _RunPlan(
        run_branches,
        None if floor is None else Window(run_branches.key(order[floor]), run_branches, newest_mtime),
        frozenset(keep),
        _primary_rollbacks(by_step, lie),
        tips=tuple(sorted(s for s, why in keep.items() if why == BRANCH_TIP)),
    )
    top = None if newest_verified is None else order.index(newest_verified)
    # Follow: a step gone from the primary goes only if the trainer evidently rotated it out (decided below): at
    # least K newer steps of its branch (verified, or saved on the primary) or pinned by the trainer (its best)
    # exist, K being the trainer's own rule (request.keeps: HF's save_total_limit; 0 when its bookkeeping names
    # each one it keeps, so any other is dropped), else the most the primary was seen holding at once by this
    # process, which must have seen the step there. A wipe, a restore (the same bytes keep their record) or an
    # `rm` adds no newer step: what they removed stays (docs/retention.md, "What is evidence of a rotation").
    mine = request.sightings
    if request.follow:
        holding = [s for s in order if s in verified and by_step[s][0]]
        # K counts what the primary holds above the newest step it lost: a checkpoint restored under a gap (or
        # left under an `rm`) is no slot of the trainer's rotation.
        above = max((place for place, s in enumerate(order) if not by_step[s][0]), default=-1)
        plan.most = max(mine.most.get(run, 0), sum(order.index(s) > above for s in holding))
        plan.seen = {(run, s) for s in holding} | {(r, s) for r, s in mine.seen if r == run and s in by_step}
    if newest_verified is not None:
        tip_primary, tip_mirror = by_step[newest_verified]
        plan.newest = [s.rel for s in (*tip_primary, *tip_mirror)]
        # The primary lost its newest verified step (follow: holds nothing as new): shrink nothing.
        lost = (
            not window or run_branches.key(window[-1]) < run_branches.key(newest_verified)
            if request.follow
            else not tip_primary
        )
        if lost and newest_verified not in forgotten:
            plan.paused = newest_verified
    # The steps that would replace a retired one are the window: all must be verified and whole first.
    # Under space pressure, a window's size of verified, whole newer steps is enough.
    window_whole = bool(window) and all(s in whole for s in window)
    whole_above = 0
    deletable: set[int] = set()
    if floor is not None and plan.paused is None:
        for place in range(len(order) - 1, -1, -1):
            step = order[place]
            enough = window_whole or (request.space_pressure and whole_above >= n)
            if place < floor and enough and keep.get(step, BRANCH_TIP) == BRANCH_TIP and step not in unconfirmed:
                deletable.add(step)
            whole_above += step in whole
    for place, step in enumerate(order):
        on_primary, on_mirror = by_step[step]
        why: str | None = None  # why the step is kept, decided once for all of its files (None: it may go)
        if step in keep:
            why = keep[step]
        elif step in unconfirmed:
            why = UNCONFIRMED
            if plan.paused is None and (not on_primary if request.follow else floor is not None and place < floor):
                plan.unconfirmed_retired += [(f, step) for f in on_mirror]
                on_mirror = []  # (decided in plan_prune, as skipped: one decision per file)
        elif plan.paused is not None:
            why = PAUSED
        elif request.follow:  # the trainer let it go (on evidence): once its newest is verified and whole here
            branch = run_branches.of.get(step, run_branches.top)
            newer = {  # (the trainer's saves not mirrored yet count: deletion waits for its newest all the same)
                s
                for s in order[place + 1 :]
                if (s in verified or by_step[s][0]) and run_branches.of.get(s, run_branches.top) == branch
            }
            entries = [manifest.get(f.rel) for f in on_mirror]
            rotated = mine.rotated(run, step, entries, len(newer | pinned), plan.most, request.keeps.get(run))
            why = NOT_ROTATED if not (rotated or step in forgotten) else None if window_whole else NEWER_UNVERIFIED
            plan.unrotated += (step,) * (why == NOT_ROTATED)
        elif floor is None or place >= floor:
            why = NEWER_THAN_KEPT if top is None or place > top else UNVERIFIED
        elif step not in deletable:
            why = NEWER_UNVERIFIED
        # An abandoned branch's tip is kept on the mirror; the primary is bounded all the same.
        bounded_tip = why == BRANCH_TIP and policy.primary and step in deletable and step in verified
        for side, files in ((PRIMARY, on_primary), (MIRROR, on_mirror)):
            if why is None or (bounded_tip and side == PRIMARY):
                if side == MIRROR or policy.primary:  # else the primary is not ours to prune
                    plan.candidates += [Deletion(side, f, step, STEP, units.get(f.rel, "")) for f in files]
            else:
                plan.kept += [Kept(side, f.rel, step, why) for f in files]
    return plan


def _follow_stepless(
    primary: Snapshot, mirror: Snapshot, manifest: Mapping[str, ManifestEntry], request: PruneRequest, kept: list[Kept]
) -> tuple[list[Kept], list[Deletion], Sightings]:
    """Follow mode, checkpoint files without a step (Lightning's `{epoch}-{val_loss:.2f}`): the trainer
    keeps what its primary holds; a mirror file gone from it goes once the trainer's newest such file of the
    run (by mtime) is verified and whole on the mirror, on the evidence of a rotation _plan_run asks for
    (newer: recorded later). Aliases (`last.ckpt`) are not followed. Also what this process saw of such files."""
    mine = request.sightings
    layout = request.layout
    if not request.follow or layout is None or layout.folders:
        return kept, [], Sightings()

    def followed(k: Kept) -> bool:
        return k.why == NO_STEP and layout.is_unit_name(k.rel.rsplit("/", 1)[-1]) and not layout.is_alias(k.rel)

    tips: dict[str, FileState] = {}
    most: Counter[str] = Counter()
    seen: set[tuple[str, int | str]] = set()
    for f in (primary.files[k.rel] for k in kept if k.volume == PRIMARY and followed(k)):
        if f.mtime_ns <= request.lie_after_ns and (f.run not in tips or f.mtime_ns > tips[f.run].mtime_ns):
            tips[f.run] = f
        if exact_copy(f, manifest, mirror.files):
            most[f.run] += 1
            seen.add((f.run, f.rel))
    on_mirror = [mirror.files[k.rel] for k in kept if k.volume == MIRROR and followed(k)]
    seen |= {(f.run, f.rel) for f in on_mirror if (f.run, f.rel) in mine.seen}
    most |= Counter(mine.most)  # (the larger of each)
    out: list[Kept] = []
    gone: list[Deletion] = []
    for k in kept:
        if not followed(k):
            out.append(k)
            continue
        if k.volume == PRIMARY or k.rel in primary.files:
            out.append(dataclasses.replace(k, why=FOLLOWED))
            continue
        f = mirror.files[k.rel]
        entry, tip = manifest.get(k.rel), tips.get(f.run)
        tip_entry = None if tip is None else manifest.get(tip.rel)
        newer = [  # (or kept by the trainer)
            g
            for g in on_mirror
            if g.run == f.run
            and (g.rel in request.pointed or ((e := manifest.get(g.rel)) and entry and e.seq > entry.seq))
        ]
        evident = mine.rotated(f.run, f.rel, [entry], len(newer), most[f.run], request.keeps.get(f.run))
        why = (
            POINTER
            if k.rel in request.pointed
            else UNVERIFIED
            if entry is None
            else UNCONFIRMED
            if not _as_recorded(f, entry)
            else PAUSED
            if tip is None or tip_entry is None
            else NOT_ROTATED
            if not evident
            else ""
            if exact_copy(tip, manifest, mirror.files) and entry_whole(tip_entry)
            else NEWER_UNVERIFIED
        )
        if why:
            out.append(dataclasses.replace(k, why=why))
        else:
            gone.append(Deletion(MIRROR, f, None))
    return out, gone, Sightings(frozenset(seen), most)


def _primary_rollbacks(by_step: dict[int, _Sides], lie: float) -> tuple[tuple[int, int], ...]:
    """The rollbacks of a run as its primary files alone show them (each file past the lie unknown)."""
    mtimes = {
        step: max(0, *(0 if f.mtime_ns > lie else f.mtime_ns for f in on_primary))
        for step, (on_primary, _on_mirror) in by_step.items()
        if on_primary
    }
    return branches(mtimes).rollbacks


def deletion_order(d: Deletion) -> tuple[bool, int, str, str, bool]:
    """Orphan temp files and folders first (pure waste), then the oldest steps; primary before mirror,
    because a primary file may only go while its verified mirror copy is still there; a folder unit's
    files together."""
    return (d.kind == STEP, d.step if d.step is not None else -1, d.unit, d.rel, d.volume != PRIMARY)


def exact_copy(src: FileState, manifest: Mapping[str, ManifestEntry], mirror_files: Mapping[str, FileState]) -> bool:
    """The mirror holds a verified copy of exactly this primary file: recorded from a source of this
    size and mtime (so with this content hash), passed its validator, and present with that size."""
    entry = manifest.get(src.rel)
    return entry is not None and entry_passed(entry) and why_copy(src, entry, mirror_files.get(src.rel)) is None


def _as_recorded(dst: FileState, entry: ManifestEntry | None) -> bool:
    """The mirror file is, by size and mtime, what its record says was stored (or has no record to contradict)."""
    return entry is None or (dst.size == entry.size and abs(dst.mtime_ns - entry.stored_mtime_ns) <= MTIME_TOLERANCE_NS)


def _step_verified(
    primary_files: Sequence[FileState], mirror_files: Sequence[FileState], manifest: Mapping[str, ManifestEntry]
) -> bool:
    """All of a step's files are on the mirror as recorded, with a passing verdict, and current."""
    on_mirror = {f.rel: f for f in mirror_files}
    return (
        bool(mirror_files)
        and all(
            (entry := manifest.get(dst.rel)) is not None and _as_recorded(dst, entry) and entry_passed(entry)
            for dst in mirror_files
        )
        and all(exact_copy(src, manifest, on_mirror) for src in primary_files)
    )
