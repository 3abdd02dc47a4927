"""Pure retention planning: which checkpoints to delete on each side, which to keep and why.

    snapshots of both sides + manifest + in-flight set + now + policy  ->  PrunePlan

Checkpoints are grouped by run (their folder relative to the root) and ordered by (branch, step): a
rollback (a lower step written after a higher one, see mirrord.core.branches) starts a newer branch. A step
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

Every candidate then passes the guards (mirrord.core.guards); a veto moves it to `skipped` with its
reason. A view that may be partial (a listing error) or a mirror that looks unmounted refuses the
whole plan: it deletes nothing.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import PurePath
from typing import TYPE_CHECKING, Protocol, overload

from mirrord.core.branches import Branches, branches, lying_after_ns
from mirrord.core.guards import GuardContext, veto
from mirrord.core.layouts import Layout
from mirrord.core.model import FileState, ManifestEntry, Snapshot, entry_passed, step_of, step_reader
from mirrord.core.plan import why_copy
from mirrord.core.units import locate
from mirrord.core.vocabulary import PruneRefusal, Veto, Volume

if TYPE_CHECKING:  # the models are not loaded to answer (see mirrord.config_fast)
    from mirrord.config import PruneConfig

PRIMARY, MIRROR = Volume.PRIMARY, Volume.MIRROR

# Why a file is kept.
KEEP_LAST = "keep_last"
KEEP_EVERY = "keep_every"
NEWER_THAN_KEPT = "newer_than_kept"
NO_STEP = "no_step"
UNVERIFIED = "unverified"
NEWER_UNVERIFIED = "newer_unverified"  # retired, but a newer step is not verified yet: still the fallback

# Why a whole plan is refused.
PARTIAL_VIEW = PruneRefusal.PARTIAL_VIEW
MIRROR_UNMOUNTED = PruneRefusal.MIRROR_UNMOUNTED

STEP, ORPHAN_PART, ORPHAN_STAGING = "step", "orphan_part", "orphan_staging"


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
    def why(self) -> str:
        """Why this policy keeps a step (a reason word for logs and metrics)."""

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]:
        """The steps this policy keeps, of `steps` (oldest first) of which `verified` are mirrored and verified."""


@dataclass(frozen=True)
class KeepLast:
    """The `n` newest verified steps (`steps` come oldest first: by branch, then step)."""

    n: int
    why: str = KEEP_LAST

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]:
        """The last `n` verified steps."""
        return frozenset([s for s in steps if s in verified][-self.n:])


@dataclass(frozen=True)
class KeepEvery:
    """Milestones: every step that is a multiple of `every` (step 0 included), verified or not."""

    every: int
    why: str = KEEP_EVERY

    def preserve(self, steps: Sequence[int], verified: AbstractSet[int]) -> frozenset[int]:
        """Every step that is a multiple of `every`."""
        return frozenset(s for s in steps if s % self.every == 0)


def preserved(policies: Sequence[Policy], steps: Sequence[int], verified: AbstractSet[int]) -> dict[int, str]:
    """Keep if any policy keeps: step -> the first policy's reason."""
    kept: dict[int, str] = {}
    for policy in policies:
        for step in policy.preserve(steps, verified):
            kept.setdefault(step, policy.why)
    return kept


def policies_for(config: PruneConfig) -> tuple[Policy, ...]:
    """The retention policies the prune config asks for (keep_last, and keep_every when set)."""
    policies: list[Policy] = [KeepLast(config.keep_last)]
    if config.keep_every is not None:
        policies.append(KeepEvery(config.keep_every))
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
    why: str  # keep_last | keep_every | newer_than_kept | no_step | unverified | newer_unverified


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
    kept: Sequence[Kept] = ()  # by (path, volume)
    skipped: tuple[Skipped, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()  # (reason, detail); non-empty means delete nothing
    newest: frozenset[str] = frozenset()  # files of each run's newest verified step
    windows: Mapping[str, Window] = field(default_factory=dict)  # runs with more than keep_last steps
    preserved: Mapping[str, frozenset[int]] = field(default_factory=dict)  # run -> steps policies keep
    rollbacks: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # The rollbacks the primary's own files show, as run_rollbacks (mirrord.core.branches) reads the primary
    # listing with this plan's `now`: what the daemon warns about, without grouping the tree again. None
    # when not worked out here (folder layouts group by unit, run_rollbacks by file).
    primary_rollbacks: Mapping[str, tuple[tuple[int, int], ...]] | None = None
    # Each run's decisions with what they were made from: a later plan given this one as `previous`
    # (PruneRequest) reuses those of the runs it finds unchanged.
    reuse: _Reuse | None = field(default=None, compare=False, repr=False)
    guards: GuardContext | None = None  # what the candidates were vetted with (the executor re-uses it)

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
        """This plan as `retired` reads it, and nothing else: what a caller keeps between rescans to judge
        partial listings by. Without the per-file decisions (kept, skipped, deletions) and the guards'
        observations, which are as large as the tree and would otherwise live until the next plan."""
        windows = self.windows  # (a run without a window retires nothing: its preserved steps are never read)
        return PrunePlan(refused=self.refused, windows=windows,
                         preserved={run: steps for run, steps in self.preserved.items() if run in windows})


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
class NewestPresent:
    """The retention window: the `n` newest steps present (on either side, verified or not).

    Steps below it are retired (not worth copying, deleted once the window is verified); the `n` newest
    verified steps are what keep_last keeps. A policy object, so that a unit of checkpoints other than a
    file step can bring its own window.
    """

    n: int

    def window(self, steps: Sequence[int]) -> Sequence[int]:
        """The newest `n` of `steps` (oldest first)."""
        return steps[-self.n:]


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
    never make room for the copies that would verify them.
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
    window: NewestPresent | None = None  # None: the keep_last newest steps present
    layout: Layout | None = None  # folder layouts: a folder unit's files are one step, deleted together
    # The caller's last plan (a daemon's previous rescan): a run whose files, manifest entries and everything
    # else its decisions read are unchanged since keeps those decisions instead of being planned again.
    # The plan is the same with or without it; only the work differs. `replans`: the caller will plan
    # again (a daemon): the plan keeps what the next one needs for that (a one-shot command does not).
    previous: PrunePlan | None = None
    replans: bool = False

    @property
    def lie_after_ns(self) -> float:
        """An mtime beyond this (now + the allowed clock skew) is a lying clock: no evidence of order."""
        return lying_after_ns(self.now, self.policy.future_skew_seconds)

    @property
    def floor(self) -> NewestPresent:
        """The least retention keeps of each run: the window, or the keep_last newest steps present."""
        return self.window if self.window is not None else NewestPresent(self.policy.keep_last)

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


def plan_prune(
    primary: Snapshot, mirror: Snapshot, manifest: Mapping[str, ManifestEntry], request: PruneRequest
) -> PrunePlan:
    """The prune plan for one cycle. Pure: the same inputs give the same plan."""
    refused = _refusals(primary, mirror, manifest, request.mirror_is_mount)
    runs, kept, units = _by_run(primary, mirror, request.step_regex, request.layout)
    reuse = _Reuse.of(request, manifest) if request.replans else None
    earlier = reuse.earlier(request.previous) if reuse is not None else {}
    lie = request.lie_after_ns
    candidates: list[Deletion] = []
    kept_runs: list[_KeptSteps] = []
    skipped: list[Skipped] = []
    newest: set[str] = set()
    windows: dict[str, Window] = {}
    keeps: dict[str, frozenset[int]] = {}
    rollbacks: dict[str, tuple[tuple[int, int], ...]] = {}
    by_file = request.layout is None or not request.layout.folders
    primary_rollbacks: dict[str, tuple[tuple[int, int], ...]] = {}
    for run, by_step in runs.items():
        if reuse is None:
            decided = _plan_run(by_step, manifest, mirror.files, request, units)
        else:
            memo = earlier.get(run)
            if memo is None or not memo.holds(by_step, manifest, lie):
                memo = _RunMemo.of(by_step, manifest, lie, _plan_run(by_step, manifest, mirror.files, request, units))
            reuse.runs[run] = memo
            decided = memo.decided
        if decided.window is not None:
            windows[run] = decided.window
        if decided.branches.rollbacks:
            rollbacks[run] = decided.branches.rollbacks
        if decided.primary_rollbacks:
            primary_rollbacks[run] = decided.primary_rollbacks
        keeps[run] = decided.keep_steps
        newest.update(decided.newest)
        if decided.kept:
            kept_runs.append((by_step, decided.kept))
        skipped.extend(decided.skipped)
        candidates.extend(decided.candidates)
    candidates.extend(Deletion(Volume.MIRROR, state, None, ORPHAN_PART) for state in mirror.partials.values())
    candidates.extend(Deletion(Volume.MIRROR, state, None, ORPHAN_STAGING) for state in mirror.staging.values())

    ctx = request.guards(frozenset(newest))
    deletions: list[Deletion] = []
    held: dict[tuple[str, str], str] = {}  # (volume, folder unit) -> why one of its files is kept
    for cand in candidates:
        reason = veto(cand.volume, cand.state, ctx)
        if reason is None:
            deletions.append(cand)
        else:
            skipped.append(Skipped(cand.volume, cand.rel, cand.step, reason, cand.state.size))
            if cand.unit:
                held.setdefault((cand.volume, cand.unit), reason)
    if held:  # a folder unit goes whole or not at all: one kept file keeps all of it
        for cand in [d for d in deletions if (d.volume, d.unit) in held]:
            deletions.remove(cand)
            skipped.append(Skipped(cand.volume, cand.rel, cand.step, held[(cand.volume, cand.unit)], cand.state.size))
    deletions.sort(key=deletion_order)
    return PrunePlan(
        deletions=() if refused else tuple(deletions),
        kept=KeptFiles(kept, kept_runs),
        skipped=tuple(sorted(skipped, key=_BY_PATH)),
        refused=tuple(refused),
        newest=frozenset(newest),
        windows=windows,
        preserved=keeps,
        rollbacks=rollbacks,
        primary_rollbacks=primary_rollbacks if by_file else None,
        reuse=reuse,
        guards=ctx,
    )


_MTIME = attrgetter("mtime_ns")
_BY_PATH = attrgetter("rel", "volume")  # (rel, volume), without a Python call per item
_SIDES = (PRIMARY, MIRROR)  # the volumes of a step's _Sides, in order
# A step's files on each side: (primary, mirror). A pair, not a dict keyed by volume: a rescan makes
# one for every step of the tree.
_Sides = tuple[list[FileState] | tuple[()], list[FileState] | tuple[()]]
# A side without files: the one empty tuple, not an empty list per step (at 1,000,000 steps with one file a
# side, a step's grouping is 184 bytes instead of 232).
_NONE: tuple[()] = ()
# run -> step -> its files on each side
_Runs = dict[str, dict[int, _Sides]]


def _refusals(primary: Snapshot, mirror: Snapshot, manifest: Mapping[str, ManifestEntry],
              is_mount: bool | None) -> list[tuple[str, str]]:
    """Why the whole plan must delete nothing: a partial listing, a mirror that looks unmounted."""
    refused: list[tuple[str, str]] = [(PARTIAL_VIEW, f"{side} listing incomplete: {error}")
               for side, snap in ((Volume.PRIMARY, primary), (Volume.MIRROR, mirror)) for error in snap.errors]
    unmounted = mirror_unmounted(mirror, manifest, is_mount)
    if unmounted is not None:
        refused.append((MIRROR_UNMOUNTED, unmounted))
    return refused


def _by_run(primary: Snapshot, mirror: Snapshot, step_regex: re.Pattern[str],
            layout: Layout | None) -> tuple[_Runs, list[_KeptGroup], dict[str, str]]:
    """Stepped files grouped by run and step, per side; files without a step are kept (never pruned).
    Also file -> its folder unit (folder layouts)."""
    runs: _Runs = {}
    kept: list[_KeptGroup] = []
    units: dict[str, str] = {}
    folders = layout is not None and layout.folders
    step_of_name = step_reader(step_regex)
    for side, index, files in ((PRIMARY, 0, primary.files), (MIRROR, 1, mirror.files)):
        # A listing holds each folder's files together: the run's steps are looked up once per folder.
        last_run: str | None = None
        by_step: dict[int, _Sides] = {}
        for state in files.values():
            # _place inlined for file layouts (every file of both sides goes through here at each rescan)
            if folders:
                run, step, unit = _place(state, step_regex, layout)
                if unit:
                    units[state.rel] = unit
            else:
                run, _, name = state.rel.rpartition("/")
                step = step_of_name(name)
            if step is None:
                kept.append((side, (state,), None, NO_STEP))
                continue
            if run != last_run:
                last_run, by_step = run, runs.setdefault(run, {})
            sides = by_step.get(step)
            if sides is None:  # each side's list made with its first file (exactly sized), the other empty
                by_step[step] = ([state], _NONE) if index == 0 else (_NONE, [state])
            elif sides[index]:
                sides[index].append(state)  # type: ignore[union-attr]  # (a side with files is a list)
            else:
                by_step[step] = ([state], sides[1]) if index == 0 else (sides[0], [state])
    return runs, kept, units


def _place(state: FileState, step_regex: re.Pattern[str], layout: Layout | None) -> tuple[str, int | None, str]:
    """(run, step, folder unit or '') of one listed file: by its layout, else by its own name."""
    if layout is None or not layout.folders:
        return state.run, step_of(state.rel, step_regex), ""
    place = locate(state.rel, layout)
    if place is None or place.kind != "folder":
        return state.run, None if place is None else place.step, ""
    return place.run, place.step, place.unit


# Files a plan keeps, a group at a time: (volume, files, step, why).
_KeptGroup = tuple[str, Sequence[FileState], int | None, str]
# A run's kept steps: its files by step and side, and for each reason the steps kept for it. A few bytes a
# step, where a group per step and side was ~200 (at 1,000,000 steps, 190 MB of a daemon's peak).
_KeptSteps = tuple[dict[int, "_Sides"], dict[str, list[int]]]


class KeptFiles(Sequence[Kept]):
    """What a plan keeps, one Kept per file in (path, volume) order, made only when first read: a daemon
    plans over every file of both sides at each rescan and reads these only to log them at debug level."""

    __slots__ = ("_groups", "_made", "_runs")

    def __init__(self, groups: Sequence[_KeptGroup] = (), runs: Sequence[_KeptSteps] = ()) -> None:
        self._groups = groups
        self._runs = runs
        self._made: tuple[Kept, ...] | None = None

    def _all(self) -> tuple[Kept, ...]:
        if self._made is None:
            made = [Kept(side, state.rel, step, why) for side, states, step, why in self._groups for state in states]
            made += [Kept(side, state.rel, step, why) for by_step, whys in self._runs for why, steps in whys.items()
                     for step in steps for side, states in zip(_SIDES, by_step[step], strict=True) for state in states]
            self._made = tuple(sorted(made, key=_BY_PATH))
            self._groups = self._runs = ()
        return self._made

    @overload
    def __getitem__(self, index: int) -> Kept: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Kept]: ...

    def __getitem__(self, index: int | slice) -> Kept | Sequence[Kept]:
        return self._all()[index]

    def __len__(self) -> int:
        if self._made is not None:
            return len(self._made)
        return sum(len(g[1]) for g in self._groups) + sum(
            len(on_primary) + len(on_mirror) for by_step, whys in self._runs for steps in whys.values()
            for on_primary, on_mirror in map(by_step.__getitem__, steps))

    def __iter__(self) -> Iterator[Kept]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeptFiles | tuple):
            return self._all() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by content, like the tuple it stands for

    def __repr__(self) -> str:
        return f"KeptFiles({self._all()!r})"


@dataclass
class _RunPlan:
    branches: Branches
    window: Window | None
    keep_steps: frozenset[int]
    primary_rollbacks: tuple[tuple[int, int], ...] = ()
    newest: list[str] = field(default_factory=list)
    kept: dict[str, list[int]] = field(default_factory=dict)  # reason -> the steps kept for it
    skipped: list[Skipped] = field(default_factory=list)
    candidates: list[Deletion] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _RunMemo:
    """One run's decisions and exactly what they read, so that a later plan can tell they still hold."""

    by_step: dict[int, _Sides]  # the run's files by step and side (records kept by the scan)
    entries: dict[str, ManifestEntry | None]  # their manifest entries, by path
    # Every mtime of the run is either at most `honest_up_to` or at least `lying_from`: any lie threshold
    # between them (now + future_skew) splits the run's files as the one they were planned with did.
    honest_up_to: float
    lying_from: float
    decided: _RunPlan

    @classmethod
    def of(cls, by_step: dict[int, _Sides], manifest: Mapping[str, ManifestEntry], lie: float,
           decided: _RunPlan) -> _RunMemo:
        """What `decided` was planned from, `lie` the threshold it was planned with."""
        files = [state for sides in by_step.values() for side in sides for state in side]
        mtimes = sorted(map(_MTIME, files))
        honest = bisect_right(mtimes, lie)
        return cls(by_step, {state.rel: manifest.get(state.rel) for state in files},
                   mtimes[honest - 1] if honest else -math.inf,
                   mtimes[honest] if honest < len(mtimes) else math.inf, decided)

    def holds(self, by_step: dict[int, _Sides], manifest: Mapping[str, ManifestEntry], lie: float) -> bool:
        """The run is listed as it was (the same or equal records on the same sides of the same steps),
        each file has the very manifest entry it had, and the lie threshold splits its mtimes as before."""
        return (self.honest_up_to <= lie < self.lying_from and by_step == self.by_step
                and all(manifest.get(rel) is entry for rel, entry in self.entries.items()))


@dataclass(frozen=True)
class _Reuse:
    """What every run's decisions read besides its own files and their entries; a later plan reuses a
    run's decisions only when all of it is the same (and each run's memo holds)."""

    policy: PruneConfig
    floor: NewestPresent
    space_pressure: bool
    invalid: AbstractSet[str]
    layout: Layout | None
    step_regex: re.Pattern[str]
    runs: dict[str, _RunMemo] = field(default_factory=dict)

    @classmethod
    def of(cls, request: PruneRequest, manifest: Mapping[str, ManifestEntry]) -> _Reuse | None:
        """None when the manifest makes its entries when asked (mirrord.store.packed): then no entry is
        ever the one recorded before, and nothing could be reused."""
        if not isinstance(manifest, dict):
            return None
        return cls(request.policy, request.floor, request.space_pressure, request.invalid, request.layout,
                   request.step_regex)

    def earlier(self, previous: PrunePlan | None) -> Mapping[str, _RunMemo]:
        """The runs of `previous` planned under the same conditions as this plan."""
        last = previous.reuse if previous is not None else None
        if last is None or (last.policy, last.floor, last.space_pressure, last.layout, last.step_regex) != (
                self.policy, self.floor, self.space_pressure, self.layout, self.step_regex):
            return {}
        return last.runs if last.invalid == self.invalid else {}


def _plan_run(by_step: dict[int, _Sides], manifest: Mapping[str, ManifestEntry],
              mirror_files: Mapping[str, FileState], request: PruneRequest, units: Mapping[str, str]) -> _RunPlan:
    """One run: its branches and window, what each policy keeps, and its deletion candidates."""
    policy, floor_policy = request.policy, request.floor
    # When the trainer wrote each step: the primary's word, else the mirror's (it keeps the source mtime).
    # An mtime beyond the allowed skew is a lying clock: it says nothing about order (as 0 does).
    lie = request.lie_after_ns
    mtimes: dict[int, int] = {}
    primary_alone = True  # every step has primary files, none past the lie: the primary's own order is this
    for step, (on_primary, on_mirror) in by_step.items():
        listed = on_primary or on_mirror
        mtime = listed[0].mtime_ns if len(listed) == 1 else max(map(_MTIME, listed))
        if mtime > lie:
            mtime, primary_alone = 0, False
        elif not on_primary:
            primary_alone = False
        mtimes[step] = mtime
    run_branches = branches(mtimes)
    # Oldest first, by (branch, step): run_branches.key. Without a rollback every step is on branch 0,
    # which is plain step order. A step's place in `order` then stands for its key: each step is there
    # once, so comparing places compares keys (no key tuple per step).
    if run_branches.rollbacks:
        of = run_branches.of
        keys = {step: (of[step], step) for step in by_step}
        order = sorted(by_step, key=keys.__getitem__)
    else:
        order = sorted(by_step)
    verified = {step for step, (on_primary, on_mirror) in by_step.items()
                if _step_verified(on_primary, on_mirror, manifest, mirror_files)}
    keep = preserved(policies_for(policy), order, verified)
    kept_window = floor_policy.window([s for s in order if s in verified])
    # Retired: below the window of steps present. Deletable: retired, not kept by a policy, and the
    # window verified (see below). Every step listed has a file on one side at least.
    invalid = request.invalid
    present = order if not invalid else [s for s in order if by_step[s][1]
                                         or any(f.rel not in invalid for f in by_step[s][0])]
    window = floor_policy.window(present)
    floor = order.index(window[0]) if len(present) > len(window) else None  # the window's first place
    plan = _RunPlan(run_branches, None if floor is None else Window(run_branches.key(order[floor]), run_branches,
                                                                    max(mtimes.values())),
                    frozenset(keep), run_branches.rollbacks if primary_alone else _primary_rollbacks(by_step, lie))
    if kept_window:
        top_primary, top_mirror = by_step[kept_window[-1]]
        plan.newest = [s.rel for s in (*top_primary, *top_mirror)]
    # The steps that would replace a retired one are the window: all must be verified first (a torn or
    # unfinished newest step keeps every older one). Under space pressure, a window's size of verified
    # newer steps is enough.
    window_verified = all(s in verified for s in window)
    verified_above = 0
    deletable: set[int] = set()
    if floor is not None:
        for place in range(len(order) - 1, -1, -1):
            step = order[place]
            enough = window_verified or (request.space_pressure and verified_above >= floor_policy.n)
            if place < floor and enough and step not in keep:
                deletable.add(step)
            verified_above += step in verified
    top = order.index(kept_window[-1]) if kept_window else None  # the newest verified step's place
    kept = plan.kept.setdefault
    for place, step in enumerate(order):
        # Why the step is kept, decided once for all of its files (None: it may go).
        why: str | None = None
        if step in keep:
            why = keep[step]
        elif floor is None or place >= floor:
            why = NEWER_THAN_KEPT if top is None or place > top else UNVERIFIED
        elif step not in deletable:
            why = NEWER_UNVERIFIED
        if why is not None:
            kept(why, []).append(step)
            continue
        on_primary, on_mirror = by_step[step]
        if policy.primary:  # else the primary is not ours to prune
            for state in on_primary:
                if not exact_copy(state, manifest, mirror_files):
                    plan.skipped.append(Skipped(PRIMARY, state.rel, step, Veto.UNMIRRORED, state.size))
                else:
                    plan.candidates.append(Deletion(PRIMARY, state, step, STEP, units.get(state.rel, "")))
        for state in on_mirror:
            plan.candidates.append(Deletion(MIRROR, state, step, STEP, units.get(state.rel, "")))
    return plan


def _primary_rollbacks(by_step: dict[int, _Sides], lie: float) -> tuple[tuple[int, int], ...]:
    """The rollbacks of a run as its primary files alone show them: each file past the lie counts as
    unknown (0), then its step's newest file (run_rollbacks, for one run)."""
    mtimes = {step: max(0, *(0 if f.mtime_ns > lie else f.mtime_ns for f in on_primary))
              for step, (on_primary, _on_mirror) in by_step.items() if on_primary}
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
    return (
        entry is not None and entry_passed(entry)
        and why_copy(src, entry, mirror_files.get(src.rel)) is None
    )


def _step_verified(
    primary_files: Sequence[FileState],
    mirror_files: Sequence[FileState],
    manifest: Mapping[str, ManifestEntry],
    mirror_all: Mapping[str, FileState],
) -> bool:
    """All of a step's files are on the mirror, recorded with a matching size, and current."""
    if not mirror_files:
        return False
    recorded = manifest.get
    for dst in mirror_files:
        entry = recorded(dst.rel)
        if entry is None or entry.size != dst.size or not entry_passed(entry):
            return False
    for src in primary_files:  # noqa: SIM110 - no generator: this runs for every step at each rescan
        if why_copy(src, recorded(src.rel), mirror_all.get(src.rel)) is not None:
            return False
    return True
