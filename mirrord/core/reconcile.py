"""One decision for every command: what to copy, what retention let go of, what to delete, how far behind,
or why nothing may be done at all.

    primary snapshot + mirror snapshot + manifest + config + now + in-flight + settle predicate  ->  View

`mirrord run`, `sync`, `prune` and `status` all decide through `reconcile`, so they cannot disagree: a
mirror that looks unmounted is refused by each of them, a step retention retired is lag for none of
them. Pure: the caller lists, stats and observes; this only reads what it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING

from mirrord.core.contributions import Sharing
from mirrord.core.jobs import CopyJob
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.plan import plan_copies, plan_unit_copies
from mirrord.core.retention import (
    NO_SIGHTINGS,
    PARTIAL_VIEW,
    PrunePlan,
    PruneRequest,
    Sightings,
    mirror_unmounted,
    plan_prune,
)
from mirrord.core.units import Completeness, Unit
from mirrord.vocabulary import PruneRefusal

if TYPE_CHECKING:
    from mirrord.config import Config


@dataclass(frozen=True)
class Facts:
    """What the caller knows about the world besides the listings; each default means "not checked".

    `mirror_problem`: the mirror cannot be trusted at all (not the pinned volume): refuse, whatever the
    listing says. `mirror_is_mount`: whether the mirror root is a mount point (None: unknown, or
    meaningless for an object store); consulted only when `mirror_must_be_mountpoint` is set.
    `observed`: (volume, rel) -> seconds this process has seen the file unchanged (monotonic), for the
    min-age guard. `invalid`: primary files that failed their format validator as they are now.
    `roots`: "primary"/"mirror" -> root path, for the path guard. `space_pressure`: the mirror cannot
    take the next copy (see mirrord.core.retention.PruneRequest). `forget`, `pointed`, `keeps`,
    `sightings`: checkpoints the operator let go, mirror paths a pointer names, how many checkpoints each
    run's trainer keeps by its own record, what this process saw (mirrord.core.retention.PruneRequest).
    """

    mirror_problem: str | None = None
    mirror_is_mount: bool | None = None
    observed: Mapping[tuple[str, str], float] | None = None
    invalid: AbstractSet[str] = frozenset()
    roots: Mapping[str, PurePath] | None = None
    space_pressure: bool = False
    forget: frozenset[tuple[str, int]] = frozenset()
    pointed: frozenset[str] = frozenset()
    keeps: Mapping[str, float] = field(default_factory=dict)
    sightings: Sightings = NO_SIGHTINGS


@dataclass(frozen=True)
class View:
    """What one listing of both sides means.

    `jobs` are what to copy now, newest step first, without the steps retention retired (empty when
    refused); `unsettled` are files that need a copy but are still being written; `behind` are the lag
    inputs: settled primary files without an intact, current mirror copy that retention still wants (the
    jobs, or while refused, what the manifest does not vouch for). `prune` is the retention plan (refused
    when the view is refused or partial: it then deletes nothing). `refused` says why nothing may be
    copied or deleted ("the mirror is empty but its manifest lists 3 file(s): is it mounted?").
    """

    jobs: tuple[CopyJob, ...] = ()
    unsettled: tuple[str, ...] = ()
    behind: tuple[CopyJob, ...] = ()
    in_sync: int = 0
    prune: PrunePlan = field(default_factory=PrunePlan)
    refused: str | None = None
    retires: bool = False  # retention is on: its retired steps are neither jobs nor lag

    def retired(self, run: str, step: int | None, mtime_ns: int | None = None) -> bool:
        """Retention let go of this step: not worth copying, and its absence is not lag."""
        return self.retires and self.prune.retired(run, step, mtime_ns)


def as_recorded(manifest: Mapping[str, ManifestEntry]) -> Snapshot:
    """The mirror as its manifest describes it: what lag is judged against while the mirror is refused."""
    return Snapshot({rel: FileState(rel, e.size, e.stored_mtime_ns) for rel, e in manifest.items()})


def reconcile(
    primary: Snapshot,
    mirror: Snapshot | None,
    manifest: Mapping[str, ManifestEntry],
    config: Config,
    now: float,
    in_flight: frozenset[str] = frozenset(),
    is_settled: Callable[[FileState], bool] = lambda _state: True,  # (a caller that does not wait: status)
    *,
    facts: Facts = Facts(),  # frozen: one shared default is safe
    retired_by: PrunePlan | None = None,
    plan_retention: bool | None = None,
    is_complete: Callable[[Unit], Completeness] | None = None,
    sharing: Sharing | None = None,
    own: Mapping[str, ManifestEntry] | None = None,
) -> View:
    """The View of one listing. Pure: the same inputs give the same View (the settle predicate aside).

    `mirror` None means it could not be listed (say why in `facts.mirror_problem`). `now` is the wall
    clock for the guards. `retired_by` marks a partial listing (the files a watch event named): retirement
    is judged by that plan of the last complete listing, and no refusal or prune plan is made from a
    partial one. `plan_retention` plans retention even when prune.enabled is false (`prune --dry-run`);
    by default it is planned only when enabled. `is_complete` judges a folder unit whole (it reads the
    primary: mirrord.store.completeness.judge); without it copies are planned file by file. `sharing`:
    folder units written by several nodes (mirrord.core.contributions), this node's parts planned too.
    `own`: the entries copies are planned from (mirrord.core.nodes.own_view); retention reads `manifest`.
    """
    retires, planned = config.prune.enabled, manifest if own is None else own
    if retired_by is not None:
        plan = dataclasses.replace(retired_by, deletions=(), refused=((PARTIAL_VIEW, "a partial listing"),))
        return _copies(
            primary, mirror or Snapshot(), planned, config, is_settled, is_complete, plan, retires, None, sharing
        )
    is_mount = facts.mirror_is_mount if config.mirror_must_be_mountpoint else None
    refused = facts.mirror_problem
    if refused is None and mirror is not None:
        refused = mirror_unmounted(mirror, manifest, is_mount)
    listed = mirror if mirror is not None else as_recorded(manifest)
    if plan_retention or (plan_retention is None and retires):
        request = PruneRequest(
            policy=config.prune,
            step_regex=config.step_regex,
            now=now,
            in_flight=in_flight,
            roots=facts.roots,
            mirror_is_mount=is_mount,
            observed=facts.observed,
            invalid=facts.invalid,
            space_pressure=facts.space_pressure,
            layout=config.rules,
            forget=facts.forget,
            pointed=facts.pointed,
            keeps=facts.keeps,
            sightings=facts.sightings,
            follow=config.retention_mode[0] == "follow",
        )
        plan = plan_prune(primary, listed, manifest, request)
        if refused is not None and not plan.refused:
            plan = dataclasses.replace(plan, deletions=(), refused=((PruneRefusal.MIRROR_UNMOUNTED, refused),))
    else:
        plan = PrunePlan()
    judged = as_recorded(manifest) if refused is not None else listed  # lag while refused: the manifest's word
    return _copies(primary, judged, planned, config, is_settled, is_complete, plan, retires, refused, sharing)


def _copies(
    primary: Snapshot,
    mirror: Snapshot,
    manifest: Mapping[str, ManifestEntry],
    config: Config,
    is_settled: Callable[[FileState], bool],
    is_complete: Callable[[Unit], Completeness] | None,
    plan: PrunePlan,
    retires: bool,
    refused: str | None,
    sharing: Sharing | None = None,
) -> View:
    """The copy half of a View: jobs without retired steps, the unsettled, and the lag inputs. While
    refused, `mirror` is what the manifest records, and nothing is a job."""
    if is_complete is None:
        copies = plan_copies(primary, mirror, manifest, config.step_regex, is_settled)
    else:
        copies = plan_unit_copies(primary, mirror, manifest, config.rules, is_complete, is_settled, sharing)
    view = View(prune=plan, refused=refused, retires=retires)
    behind = tuple(j for j in copies.jobs if not view.retired(j.run, j.step, j.mtime_ns))
    return dataclasses.replace(
        view, jobs=() if refused else behind, behind=behind, unsettled=copies.unsettled, in_sync=copies.in_sync
    )
