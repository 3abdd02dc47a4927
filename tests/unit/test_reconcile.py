"""reconcile: one pure decision (what to copy, what is retired, what to delete, how far behind, or a
refusal) that `run`, `sync`, `prune` and `status` all make through, so they cannot disagree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePath
from typing import Any

import pytest

from mirrord.config import Config, load_config
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.reconcile import Facts, View, as_recorded, reconcile

NOW = 1_700_000_000.0
OLD = int((NOW - 86_400) * 1e9)
ROOTS = {"primary": PurePath("/data/ckpt"), "mirror": PurePath("/mnt/mirror/ckpt")}


def config(must_be_mount: bool = False, **prune: Any) -> Config:
    settings = {"keep_last": 2, "primary": True, "min_age_seconds": 0, **prune}
    return load_config(
        None,
        environ={},
        overrides={
            "primary": "/data/ckpt",
            "mirror": "/mnt/mirror/ckpt",
            "mirror_must_be_mountpoint": must_be_mount,
            "prune": settings,
        },
        check_roots=False,
    )


def rel(step: int, run: str = "r") -> str:
    return f"{run}/step_{step:04d}.pt"


def src(step: int, run: str = "r", size: int = 100) -> FileState:
    return FileState(rel(step, run), size, OLD + step, ino=step)


def copy_of(state: FileState) -> FileState:
    return FileState(state.rel, state.size, state.mtime_ns, ino=1000 + state.ino)


def entry(state: FileState) -> ManifestEntry:
    return ManifestEntry(state.rel, state.size, "blake3", "d" * 64, state.mtime_ns, None, NOW, validation="ok")


def world(primary_steps: range, mirrored_steps: range) -> tuple[Snapshot, Snapshot, dict[str, ManifestEntry]]:
    """Steps on the primary; of those, `mirrored_steps` copied and recorded."""
    primary = {rel(s): src(s) for s in primary_steps}
    mirror = {rel(s): copy_of(primary[rel(s)]) for s in mirrored_steps}
    manifest = {rel(s): entry(primary[rel(s)]) for s in mirrored_steps}
    return Snapshot(primary), Snapshot(mirror), manifest


def steps(jobs: Any) -> list[int | None]:
    return [j.step for j in jobs]


def test_jobs_come_newest_first_without_the_steps_retention_retired() -> None:
    """Five steps, the two newest mirrored, keep_last = 2: 1-3 are below the window (retired): neither
    jobs nor lag; with prune.primary they go from the primary, mirrored or not, the window being verified."""
    primary, mirror, manifest = world(range(1, 6), range(4, 6))
    view = reconcile(primary, mirror, manifest, config(), NOW, facts=Facts(roots=ROOTS))
    assert view.refused is None
    assert view.jobs == () and view.behind == () and view.in_sync == 2
    assert all(view.retired("r", s) for s in (1, 2, 3)) and not view.retired("r", 4)
    assert {(d.volume, d.rel) for d in view.prune.deletions} == {("primary", rel(s)) for s in (1, 2, 3)}
    assert view.prune.skipped == ()


def test_without_retention_every_missing_step_is_a_job_newest_first() -> None:
    primary, mirror, manifest = world(range(1, 6), range(4, 6))
    view = reconcile(primary, mirror, manifest, config(enabled=False), NOW)
    assert steps(view.jobs) == [3, 2, 1] and view.behind == view.jobs
    assert not view.retired("r", 1) and view.prune.deletions == ()
    planned = reconcile(primary, mirror, manifest, config(enabled=False), NOW, plan_retention=True)
    # `prune --dry-run` still sees the plan; copying ignores it while retention is off.
    assert planned.jobs == view.jobs and planned.prune.retired("r", 1) and not planned.retired("r", 1)


def test_a_new_step_is_a_job_and_lag_until_it_is_copied() -> None:
    primary, mirror, manifest = world(range(1, 4), range(1, 3))
    view = reconcile(primary, mirror, manifest, config(keep_last=3), NOW)
    assert [(j.rel, j.why) for j in view.jobs] == [(rel(3), "new")]
    assert view.behind == view.jobs


def test_unsettled_files_are_neither_jobs_nor_lag() -> None:
    """A file still being written waits: listed as unsettled, queued once the predicate says settled."""
    primary, mirror, manifest = world(range(1, 4), range(1, 2))
    still_written = rel(3)
    view = reconcile(
        primary, mirror, manifest, config(keep_last=3), NOW, is_settled=lambda state: state.rel != still_written
    )
    assert view.unsettled == (still_written,)
    assert steps(view.jobs) == [2] and steps(view.behind) == [2]


def test_in_flight_files_are_jobs_but_never_deleted() -> None:
    """The queue deduplicates jobs; the guards keep what is being copied from being pruned."""
    primary, mirror, manifest = world(range(1, 6), range(1, 6))
    view = reconcile(primary, mirror, manifest, config(), NOW, in_flight=frozenset({rel(2)}), facts=Facts(roots=ROOTS))
    assert {(s.volume, s.rel, s.reason) for s in view.prune.skipped} == {
        ("primary", rel(2), "in_flight"),
        ("mirror", rel(2), "in_flight"),
    }
    assert sorted((d.step, d.volume) for d in view.prune.deletions) == [
        (1, "mirror"),
        (1, "primary"),
        (3, "mirror"),
        (3, "primary"),
    ]


def test_an_empty_mirror_with_a_manifest_is_refused_and_lag_is_judged_against_the_manifest() -> None:
    """The mirror looks unmounted: nothing to copy, nothing to delete, and the lag counts only what the
    manifest does not vouch for (a remount brings the recorded copies back)."""
    primary, _, manifest = world(range(1, 4), range(1, 3))
    view = reconcile(primary, Snapshot(), manifest, config(keep_last=3), NOW)
    assert view.refused is not None and "is empty but its manifest lists 2 file(s)" in view.refused
    assert view.jobs == () and view.prune.deletions == ()
    assert [r for r, _ in view.prune.refused] == ["mirror_unmounted"]
    assert [j.rel for j in view.behind] == [rel(3)]


def test_a_mirror_that_must_be_a_mount_point_and_is_not_is_refused() -> None:
    primary, mirror, manifest = world(range(1, 4), range(1, 3))
    strict = config(must_be_mount=True, keep_last=3)
    view = reconcile(primary, mirror, manifest, strict, NOW, facts=Facts(mirror_is_mount=False))
    assert view.refused == "the mirror is not a mount point (mirror_must_be_mountpoint = true)"
    assert view.jobs == () and [j.rel for j in view.behind] == [rel(3)]
    assert reconcile(primary, mirror, manifest, strict, NOW, facts=Facts(mirror_is_mount=True)).refused is None
    # Not asked for: whatever the mount state, nothing to refuse.
    assert (
        reconcile(primary, mirror, manifest, config(keep_last=3), NOW, facts=Facts(mirror_is_mount=False)).refused
        is None
    )


def test_a_mirror_that_cannot_be_listed_is_refused_with_the_callers_reason() -> None:
    primary, _, manifest = world(range(1, 4), range(1, 3))
    view = reconcile(
        primary,
        None,
        manifest,
        config(keep_last=3),
        NOW,
        facts=Facts(mirror_problem="not the volume mirrord started on"),
    )
    assert view.refused == "not the volume mirrord started on"
    assert view.jobs == () and view.prune.deletions == () and view.prune.refused
    assert [j.rel for j in view.behind] == [rel(3)]


def test_a_partial_listing_is_judged_by_the_last_complete_plan_and_never_refused_or_pruned() -> None:
    """Watch hints name a few files: an empty mirror listing of them is not an unmounted mirror, and
    retirement comes from the last complete listing (a partial one cannot see the window)."""
    primary, mirror, manifest = world(range(1, 6), range(4, 6))
    full = reconcile(primary, mirror, manifest, config(), NOW)
    hinted = Snapshot({rel(2): src(2), rel(6): src(6)})
    view = reconcile(hinted, Snapshot(), manifest, config(), NOW, retired_by=full.prune)
    assert view.refused is None
    assert steps(view.jobs) == [6]  # step 2 is retired by the last complete plan
    assert view.prune.deletions == () and view.prune.refused


def test_a_listing_error_refuses_pruning_but_not_copying() -> None:
    primary, mirror, manifest = world(range(1, 4), range(1, 2))
    partial = Snapshot(dict(primary.files), errors=("r: permission denied",))
    view = reconcile(partial, mirror, manifest, config(keep_last=3), NOW)
    assert view.refused is None and steps(view.jobs) == [3, 2]
    assert view.prune.deletions == () and [r for r, _ in view.prune.refused] == ["partial_view"]


def test_files_that_failed_their_validator_do_not_retire_the_step_before_them() -> None:
    """keep_last = 1 and a torn step 2: step 1 stays in the window, so it is still worth copying."""
    primary, mirror, manifest = world(range(1, 3), range(0))
    torn = reconcile(primary, mirror, manifest, config(keep_last=1), NOW, facts=Facts(invalid=frozenset({rel(2)})))
    assert steps(torn.jobs) == [2, 1]
    assert steps(reconcile(primary, mirror, manifest, config(keep_last=1), NOW).jobs) == [2]


@pytest.mark.parametrize("make", [lambda: View(), lambda: reconcile(Snapshot(), Snapshot(), {}, config(), NOW)])
def test_an_empty_world_needs_nothing(make: Callable[[], View]) -> None:
    view = make()
    assert (view.jobs, view.behind, view.unsettled, view.refused) == ((), (), (), None)


def test_the_manifest_as_recorded_is_what_the_mirror_held_when_it_was_written() -> None:
    state = src(1)
    recorded = as_recorded({state.rel: entry(state)})
    assert recorded.files[state.rel].size == state.size and recorded.files[state.rel].mtime_ns == state.mtime_ns


def test_reconcile_is_pure() -> None:
    primary, mirror, manifest = world(range(1, 6), range(3, 6))
    before = (dict(primary.files), dict(mirror.files), dict(manifest))
    assert reconcile(primary, mirror, manifest, config(), NOW) == reconcile(primary, mirror, manifest, config(), NOW)
    assert (primary.files, mirror.files, manifest) == before
