"""Pure planning of what to copy: a function of two snapshots, the manifest and a settle predicate; file by
file (plan_copies), or unit by unit (plan_unit_copies: folder units, aliases, a node's share of a unit)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from mirrord.core.contributions import Sharing
from mirrord.core.jobs import CopyJob
from mirrord.core.model import FileState, ManifestEntry, Snapshot, entry_passed, step_of, version_key
from mirrord.core.units import Completeness, Unit, group_units
from mirrord.layouts import Layout

# Filesystems with coarse timestamps (FAT: 2 s, some SMB/NFS setups: 1 s) round the mtime we set.
MTIME_TOLERANCE_NS = 2_000_000_000


REPLACED = "replaced"  # CopyJob.why: the source is another file than the one copied, by identity


@dataclass(frozen=True)
class CopyPlan:
    """What to copy now (newest step first), what is still being written, what is already in sync."""

    jobs: tuple[CopyJob, ...]
    unsettled: tuple[str, ...] = ()
    in_sync: int = 0


def why_copy(src: FileState, entry: ManifestEntry | None, dst: FileState | None) -> str | None:
    """Why `src` must be (re)copied, or None when the mirror holds an intact, current copy."""
    if entry is None:
        return "unrecorded" if dst is not None else "new"
    if entry.size != src.size or entry.source_mtime_ns != src.mtime_ns:
        return "changed"
    # Other bytes put in place with the same size and mtime (`cp -p`, `rsync -a`, `tar x`), or the same bytes
    # put back (a restore): another inode or ctime than the copied source's. Read again to tell which.
    if entry.source_ino and (src.ino, src.ctime_ns) != (entry.source_ino, entry.source_ctime_ns):
        return REPLACED
    if dst is None:
        return "mirror_missing"
    # Compared with what the mirror stored, which is not always what it was given (clamped, rounded).
    if dst.size != entry.size or abs(dst.mtime_ns - entry.stored_mtime_ns) > MTIME_TOLERANCE_NS:
        return "mirror_mismatch"
    return None


def newest_first(job: CopyJob) -> tuple[bool, int, int]:
    """Queue order: the highest step first (the one a resume needs), then the newest mtime."""
    return (job.step is None, -(job.step or 0), -job.mtime_ns)


def sort_newest_first(jobs: list[CopyJob]) -> None:
    """`jobs.sort(key=newest_first)` without a key tuple per job (at 1,000,000 new files those are 140 MB
    at once): two stable sorts, the minor key first, whose keys are the jobs' own numbers."""
    jobs.sort(key=attrgetter("mtime_ns"), reverse=True)  # reverse=True keeps equal keys in their order
    jobs.sort(key=lambda job: float("-inf") if job.step is None else job.step, reverse=True)  # no step: last


def plan_copies(
    primary: Snapshot,
    mirror: Snapshot,
    manifest: Mapping[str, ManifestEntry],
    step_regex: re.Pattern[str],
    is_settled: Callable[[FileState], bool] = lambda _state: True,
) -> CopyPlan:
    """Every committed primary file whose mirror copy is absent, stale or not recorded, newest first."""
    jobs: list[CopyJob] = []
    unsettled: list[str] = []
    in_sync = 0
    for rel, src in primary.files.items():
        why = why_copy(src, manifest.get(rel), mirror.files.get(rel))
        if why in ("changed", REPLACED) and why_copy(src, manifest.get(version_key(rel)), None) == "mirror_missing":
            why = None  # the source is the version recorded beside the verified copy (Engine.stage)
        if why is None:
            in_sync += 1
        elif not is_settled(src):
            unsettled.append(rel)
        else:
            jobs.append(CopyJob(rel, src.size, src.mtime_ns, step_of(rel, step_regex), why))
    sort_newest_first(jobs)
    return CopyPlan(tuple(jobs), tuple(sorted(unsettled)), in_sync)


def plan_unit_copies(
    primary: Snapshot,
    mirror: Snapshot,
    manifest: Mapping[str, ManifestEntry],
    layout: Layout,
    is_complete: Callable[[Unit], Completeness],
    is_settled: Callable[[FileState], bool] = lambda _state: True,
    sharing: Sharing | None = None,
) -> CopyPlan:
    """What to copy, unit by unit, newest first. A file layout plans file by file, exactly as
    plan_copies; a folder unit is one job (all its files, published together) once `is_complete`
    says it is whole, and is re-published whole when any file of it is absent, stale or unrecorded
    on the mirror, or the mirror's folder holds a file the primary's does not. Aliases and tag files
    are planned only once the newest unit of their run is in sync (DeepSpeed's `latest` names a folder
    that must be there first; older ones retention may never copy). With `sharing` (folders written by
    several nodes), a unit that is not whole here but whose local share is done is this node's part:
    a job marked `part`, unless that part is recorded and on the mirror already."""
    if not layout.folders:
        base = plan_copies(primary, mirror, manifest, layout.step_regex, is_settled)
        return plan_file_aliases(base, primary, manifest, layout) if layout.aliases else base
    ours = group_units(primary.files.values(), layout)
    theirs = group_units(mirror.files.values(), layout)
    jobs: list[CopyJob] = []
    unsettled: list[str] = []
    in_sync = 0
    newest: dict[str, tuple[int, bool]] = {}  # run -> (its highest step, that unit needs a copy)
    # Checkpoints first: an alias or tag file waits while the newest checkpoint of its run needs a copy.
    for unit in sorted(ours.values(), key=lambda u: u.role != "checkpoint"):
        if unit.role != "checkpoint":
            why = why_copy(unit.files[0], manifest.get(unit.rel), mirror.files.get(unit.rel))
            if why is not None and (newest.get(unit.run, (-1, False))[1] or not is_settled(unit.files[0])):
                why = "wait"
        else:
            why = unit_why_copy(unit, theirs.get(unit.rel), manifest, mirror.files)
            step = -1 if unit.step is None else unit.step
            if step >= newest.get(unit.run, (-1, False))[0]:
                newest[unit.run] = (step, why is not None)
            if why is not None and not is_complete(unit).complete:  # not whole here: wait, or this node's part
                share = sharing.plan(unit, mirror.files) if sharing is not None else "wait"
                why = None if share == "in_sync" else share
        if why is None:
            in_sync += len(unit.files)
        elif why == "wait":
            unsettled.append(unit.rel)
        else:
            jobs.append(
                CopyJob(
                    unit.rel,
                    unit.size,
                    unit.mtime_ns,
                    unit.step,
                    why,
                    unit.paths if unit.kind == "folder" else (),
                    part=why == "part",
                )
            )
    sort_newest_first(jobs)
    return CopyPlan(tuple(jobs), tuple(sorted(unsettled)), in_sync)


def plan_file_aliases(
    base: CopyPlan, primary: Snapshot, manifest: Mapping[str, ManifestEntry], layout: Layout
) -> CopyPlan:
    """A file layout's aliases (Lightning's `last.ckpt`, a copy of the newest step): held until the newest
    step of their run is mirrored, then planned with their twins, so that an alias whose bytes are a
    mirrored step's is published from that copy instead of being copied again."""
    if not any(layout.is_alias(job.rel) for job in base.jobs):
        # Nothing to hold or pair (a tree at rest): the plan as it is (its unsettled come sorted), without
        # grouping every file of the primary into units.
        return base
    checkpoints = [u for u in group_units(primary.files.values(), layout).values() if u.role == "checkpoint"]
    newest = {u.run: u.step for u in sorted(checkpoints, key=lambda u: -1 if u.step is None else u.step)}
    waiting = {job.rel for job in base.jobs} | set(base.unsettled)
    pending_runs = {u.run for u in checkpoints if u.rel in waiting and u.step == newest.get(u.run)}
    # held: the step an alias most likely copies is not mirrored yet
    held = {job.rel for job in base.jobs if layout.is_alias(job.rel) and job.run in pending_runs}
    jobs = [
        dataclasses.replace(job, twins=twins_of(job, manifest)) if layout.is_alias(job.rel) else job
        for job in base.jobs
        if job.rel not in held
    ]
    return CopyPlan(tuple(jobs), tuple(sorted((*base.unsettled, *held))), base.in_sync)


def twins_of(job: CopyJob, manifest: Mapping[str, ManifestEntry]) -> tuple[str, ...]:
    """Mirrored checkpoints of the alias's run that may hold its very bytes: recorded with its size and a
    passing verdict; newest step first. The digest decides, and the mirror copy is re-checked against
    its record just before it is used (the shell)."""
    found = sorted(
        (
            (entry.step, rel)
            for rel, entry in manifest.items()
            if entry.run == job.run and entry.step is not None and entry.size == job.size and entry_passed(entry)
        ),
        reverse=True,
    )
    return tuple(rel for _step, rel in found)


def unit_why_copy(
    unit: Unit, mirrored: Unit | None, manifest: Mapping[str, ManifestEntry], mirror_files: Mapping[str, FileState]
) -> str | None:
    """Why a folder unit must be (re)published, or None when the mirror holds it intact and current."""
    if mirrored is None:
        return "unrecorded" if any(f.rel in manifest for f in unit.files) else "new"
    for src in unit.files:
        why = why_copy(src, manifest.get(src.rel), mirror_files.get(src.rel))
        if why is not None:
            return why
    # A mirrored file the primary's folder no longer has: if we recorded it, the trainer is deleting the
    # folder (rotation removes its files one by one) and the whole copy on the mirror must stay; an
    # unrecorded one is not the trainer's, and the folder is published again as the primary has it.
    if any(rel not in manifest for rel in set(mirrored.paths) - set(unit.paths)):
        return "changed"
    return None


@dataclass
class SettleTracker:
    """Decides when a file written in place has stopped changing.

    A file is settled when we have seen the same (inode, size, mtime, ctime) ourselves for
    `settle_seconds` on the monotonic clock. Its mtime may add delay (an mtime younger than
    `settle_seconds` by the wall clock keeps it unsettled), never remove it: a wall clock ahead of the
    file's clock (a forward step, an NFS server that lags) must not make a file still being written
    look settled. A rename into a final name commits a file at once (`mark_committed`).

    A folder unit is quiet when its whole listing (every file's identity, and the file list itself) has
    stayed the same for settle_seconds, or unit_seconds when only a pause can tell that it is whole
    (`quiet`): a rename gives no shortcut there, since savers rename files into place one by one.
    """

    settle_seconds: float
    wall: Callable[[], float]
    monotonic: Callable[[], float]
    unit_seconds: float = 30.0
    _seen: dict[str, tuple[tuple[int, int, int, int], float]] = field(default_factory=dict)
    _committed: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    _units: dict[str, tuple[int, float]] = field(default_factory=dict)  # unit -> (hash of its listing, since)

    def mark_committed(self, state: FileState) -> None:
        """The writer renamed the file into place: it is whole as it is now, no settling needed."""
        self._committed[state.rel] = state.identity

    def committed(self, state: FileState) -> bool:
        """The writer renamed `state` into place, as it is now (evidence that it is whole)."""
        return self._committed.get(state.rel) == state.identity

    def __call__(self, state: FileState, now: float | None = None) -> bool:
        """Whether `state` has stayed unchanged for settle_seconds (or was committed by a rename)."""
        key = state.identity
        if self.settle_seconds <= 0 or self._committed.get(state.rel) == key:
            return True
        now = self.monotonic() if now is None else now
        seen = self._seen.get(state.rel)
        if seen is None or seen[0] != key:
            self._seen[state.rel] = (key, now)
            return False
        if now - seen[1] < self.settle_seconds:
            return False
        age = self.wall() - state.mtime_ns / 1e9
        return not 0 <= age < self.settle_seconds

    def quiet(self, unit: Unit, guess: bool, now: float | None = None) -> bool:
        """Whether the folder unit's whole listing has stayed the same for settle_seconds (unit_seconds with
        `guess`: nothing but a pause says it is whole) on our monotonic clock, and its newest mtime is not
        younger than that by the wall clock."""
        seconds = self.unit_seconds if guess else self.settle_seconds
        now = self.monotonic() if now is None else now
        key = hash(tuple(sorted((f.rel, *f.identity) for f in unit.files)))  # units.unit_identity
        seen = self._units.get(unit.rel)
        if seen is None or seen[0] != key:
            self._units[unit.rel] = seen = (key, now)
        if now - seen[1] < seconds:
            return False
        return not 0 <= self.wall() - unit.mtime_ns / 1e9 < seconds

    def quiet_at(self, now: float) -> Callable[[Unit, bool], bool]:
        """`quiet` for one listing: every unit judged at the same instant."""
        return lambda unit, guess: self.quiet(unit, guess, now)

    def at(self, now: float) -> Callable[[FileState], bool]:
        """The predicate for one listing: every file of it judged at the same instant, so files first
        seen together settle together (and are queued together, newest step first)."""
        return lambda state: self(state, now)

    def forget(self, rel: str) -> None:
        """`rel` is gone: forget what was seen of it."""
        self._seen.pop(rel, None)
        self._committed.pop(rel, None)
        self._units.pop(rel, None)

    def retain(self, present: Container[str]) -> None:
        """A complete listing: forget every file not in it (a trainer cycling through new names must not
        grow the daemon without bound)."""
        for seen in (self._seen, self._committed, self._units):
            for rel in [rel for rel in seen if rel not in present]:
                del seen[rel]
