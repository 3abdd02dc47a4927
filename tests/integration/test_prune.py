"""Retention on real files: real torch.save checkpoints mirrored by `mirrord sync`, pruned by `mirrord prune`
(a child process) or by the Pruner the daemon uses. Checkpoints carry mtimes from the past (see
tests.support.checkpoints.save_checkpoint) so the min-age guard lets them go unless a test says otherwise."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mirrord.commands.sync import run_sync
from mirrord.config import Config
from mirrord.core.jobs import CopyJob
from mirrord.errors import NoSpaceError
from mirrord.obs.metrics import Metrics
from mirrord.service.engine import Engine
from mirrord.service.pruner import Pruner
from mirrord.store.manifest import MANIFEST_NAME, Manifest
from mirrord.store.volume import LocalMirror, LocalVolume
from tests.support.checkpoints import save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.config import load, settings
from tests.support.deep import deeper_than_path_max
from tests.support.engine import copy_once
from tests.support.logs import parse_events
from tests.support.mirror import assert_mirror_consistent

RUN = "run1"
KEEP3 = {"MIRRORD_PRUNE__KEEP_LAST": "3", "MIRRORD_PRUNE__PRIMARY": "true", "MIRRORD_COPY__SETTLE_SECONDS": "0"}


def make_run(primary: Path, steps: range = range(1, 11), **kwargs: Any) -> dict[int, Path]:
    return {s: save_checkpoint(primary / RUN / f"step_{s:04d}.pt", s, **kwargs) for s in steps}


def steps_on(root: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (root / RUN).glob("step_*.pt"))


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file below root (hidden ones and the manifest included) with its inode, size and mtime."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = (Path(dirpath) / name).lstat()
            out[str((Path(dirpath) / name).relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    out.pop(".mirrord.lock", None)  # its content (the holder's pid) changes with every command
    return out


def cli(command: str, primary: Path, mirror: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    return run_mirrord(
        command, "--primary", primary, "--mirror", mirror, "--log-format", "json", *args, env={**KEEP3, **(env or {})}
    )


def sync(primary: Path, mirror: Path) -> None:
    """Mirror every step (pruning off: with it on, a first sync copies only what the window keeps)."""
    result = cli("sync", primary, mirror, env={"MIRRORD_PRUNE__ENABLED": "false"})
    assert result.returncode == 0, result.stderr


def mirror_all(config: Config) -> Any:
    """sync with pruning off: every step mirrored (with it on, a first sync copies only the window)."""
    return run_sync(config.model_copy(update={"prune": config.prune.model_copy(update={"enabled": False})}))


def pruner_for(config: Config, **kwargs: Any) -> Pruner:
    mirror = LocalMirror(config.mirror)
    return Pruner(config, LocalVolume(config.primary), mirror, mirror.read_manifest(), Metrics(), **kwargs)


# -- `mirrord prune` ------------------------------------------------------------------------------------


def test_keep_last_three_of_ten_leaves_steps_8_to_10_on_both_sides(primary: Path, mirror: Path) -> None:
    """The issue's acceptance run: ten real checkpoints, keep_last = 3, prune.primary = true."""
    ckpts = make_run(primary)
    freed = sum(ckpts[s].stat().st_size for s in range(1, 8))
    sync(primary, mirror)
    result = cli("prune", primary, mirror)
    assert result.returncode == 0, result.stderr
    assert steps_on(primary) == steps_on(mirror) == [8, 9, 10]
    assert sorted(Manifest.load(mirror).entries) == [f"{RUN}/step_{s:04d}.pt" for s in (8, 9, 10)]
    assert_mirror_consistent(primary, mirror)
    deleted = parse_events(result.stderr, "prune.deleted")
    assert len(deleted) == 14
    assert sum(e["size"] for e in deleted if e["volume"] == "mirror") == freed
    assert all(e["manifest_entry"] == (e["volume"] == "mirror") for e in deleted)
    assert "deleted 14 file(s)" in result.stdout
    assert result.stdout.count("keep_last") == 6
    verify = run_mirrord("verify", "--primary", primary, "--mirror", mirror)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    resumed = torch.load(mirror / RUN / "step_0010.pt", map_location="cpu", weights_only=True)
    assert resumed["step"] == 10
    again = cli("prune", primary, mirror)
    assert again.returncode == 0 and parse_events(again.stderr, "prune.deleted") == []
    assert parse_events(cli("sync", primary, mirror).stderr, "copy.committed") == []


def test_a_checkpoint_with_mtime_zero_survives(primary: Path, mirror: Path) -> None:
    """mtime 0 is 'unknown', not 'old': the file stays on both sides and the veto is logged."""
    make_run(primary)
    os.utime(primary / RUN / "step_0001.pt", (0, 0))
    sync(primary, mirror)
    assert (mirror / RUN / "step_0001.pt").stat().st_mtime_ns == 0
    result = cli("prune", primary, mirror)
    assert result.returncode == 0, result.stderr
    assert steps_on(primary) == steps_on(mirror) == [1, 8, 9, 10]
    skipped = parse_events(result.stderr, "prune.skipped")
    assert {(e["volume"], e["reason"]) for e in skipped} == {("primary", "zero_mtime"), ("mirror", "zero_mtime")}
    assert "zero_mtime=2" in result.stdout


def test_a_file_touched_a_second_ago_survives(primary: Path, mirror: Path) -> None:
    """A recent mtime may be a copy or a write in flight, on either side. (Touched, the mirror's step 3
    is no longer what was recorded: unconfirmed until verified again, it is neither counted nor deleted,
    on either side.)"""
    make_run(primary)
    sync(primary, mirror)
    now = time.time()
    os.utime(mirror / RUN / "step_0003.pt", (now - 1, now - 1))
    result = cli("prune", primary, mirror)
    assert result.returncode == 0, result.stderr
    assert steps_on(primary) == [3, 8, 9, 10]
    assert steps_on(mirror) == [3, 8, 9, 10]
    assert parse_events(result.stderr, "prune.skipped") == []
    assert f"mirror   {RUN}/step_0003.pt  unconfirmed" in result.stdout


@pytest.mark.parametrize("how", ["flag", "config"])
def test_dry_run_deletes_nothing_and_prints_the_plan(primary: Path, mirror: Path, how: str) -> None:
    """--dry-run (or prune.dry_run = true) prints deletions, kept-and-why and guard skips; touches nothing."""
    make_run(primary)
    os.utime(primary / RUN / "step_0001.pt", (0, 0))
    sync(primary, mirror)
    before = (tree(primary), tree(mirror))
    args, env = (("--dry-run",), {}) if how == "flag" else ((), {"MIRRORD_PRUNE__DRY_RUN": "true"})
    result = cli("prune", primary, mirror, *args, env=env)
    assert result.returncode == 0, result.stderr
    assert (tree(primary), tree(mirror)) == before
    out = result.stdout
    assert "would delete 12 file(s)" in out
    for step in range(2, 8):
        for volume in ("mirror", "primary"):
            assert any(
                line.split()[:3] == [volume, f"{RUN}/step_{step:04d}.pt", "step"] for line in out.splitlines()
            ), (volume, step)
    assert sum(line.split()[-1] == "keep_last" for line in out.splitlines()) == 6
    assert sum(line.split()[-1] == "zero_mtime" for line in out.splitlines()) == 2
    assert "dry run: nothing was deleted" in out
    assert len(parse_events(result.stderr, "prune.would_delete")) == 12
    assert parse_events(result.stderr, "prune.deleted") == []
    [finished] = parse_events(result.stderr, "prune.finished")  # totals named for what a dry run does: nothing yet
    assert (finished["dry_run"], finished["would_delete"]) == (True, 12)
    assert finished["would_free_bytes_mirror"] > 0 and finished["would_free_bytes_primary"] > 0
    assert not {"deleted", "freed_bytes_mirror", "freed_bytes_primary"} & finished.keys()


def test_a_listing_error_deletes_nothing(primary: Path, mirror: Path) -> None:
    """A directory deeper than PATH_MAX cannot be listed (ENAMETOOLONG, even for root): the view is partial."""
    make_run(primary)
    sync(primary, mirror)
    os.close(deeper_than_path_max(primary))
    before = (tree(primary), tree(mirror))
    result = cli("prune", primary, mirror)
    assert result.returncode == 1
    assert (tree(primary), tree(mirror)) == before
    assert "REFUSED (partial_view)" in result.stdout
    assert [e["reason"] for e in parse_events(result.stderr, "prune.refused")] == ["partial_view"]
    assert parse_events(result.stderr, "prune.deleted") == []


def test_an_empty_mirror_with_a_manifest_is_refused(primary: Path, mirror: Path) -> None:
    """An unmounted mirror looks empty while the manifest (read before it vanished, or left below the
    mount point) lists files: nothing may be pruned from that view, least of all on the primary."""
    make_run(primary)
    sync(primary, mirror)
    for path in (mirror / RUN).glob("*.pt"):
        path.unlink()
    before = tree(primary)
    result = cli("prune", primary, mirror)
    assert result.returncode == 1
    assert tree(primary) == before
    assert "REFUSED (mirror_unmounted)" in result.stdout
    assert [e["reason"] for e in parse_events(result.stderr, "prune.refused")] == ["mirror_unmounted"]


def test_an_unreadable_manifest_deletes_nothing(primary: Path, mirror: Path) -> None:
    make_run(primary)
    sync(primary, mirror)
    (mirror / MANIFEST_NAME).write_text("{not json")
    before = (tree(primary), tree(mirror))
    result = cli("prune", primary, mirror)
    assert result.returncode == 1
    assert (tree(primary), tree(mirror)) == before
    assert [e["reason"] for e in parse_events(result.stderr, "prune.refused")] == ["manifest"]


def test_prune_takes_the_mirror_lock(primary: Path, mirror: Path) -> None:
    """While another mirrord holds the mirror, `mirrord prune` deletes nothing and fails."""
    make_run(primary)
    sync(primary, mirror)
    before = (tree(primary), tree(mirror))
    with LocalMirror(mirror).lock():
        result = cli("prune", primary, mirror)
    assert result.returncode == 1
    assert "another mirrord process" in result.stderr
    assert (tree(primary), tree(mirror)) == before


def test_dry_run_beside_a_running_daemon_takes_no_lock_and_writes_nothing(
    primary: Path, mirror: Path, daemon_factory: Callable[..., Any]
) -> None:
    """The daemon holds the mirror's lock; a dry run still plans, prints, and leaves every byte alone."""
    make_run(primary)
    sync(primary, mirror)
    daemon = daemon_factory().start()  # the harness daemon does not prune
    lock = mirror / ".mirrord.lock"
    holder = lock.read_text()
    before = (tree(primary), tree(mirror))
    result = cli("prune", primary, mirror, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "would delete 14 file(s)" in result.stdout
    assert (tree(primary), tree(mirror), lock.read_text()) == (*before, holder)
    [finished] = parse_events(result.stderr, "prune.finished")
    assert finished["would_delete"] == 14
    assert not daemon.exited()
    refused = cli("prune", primary, mirror)  # a real prune still needs the lock
    assert refused.returncode == 1 and "another mirrord process" in refused.stderr
    assert daemon.stop() == 0


def test_prune_on_a_mirror_that_does_not_exist_says_so_and_creates_nothing(primary: Path, tmp_path: Path) -> None:
    """A mistyped mirror is a usage error (exit 2) that names it, never a quiet "would delete 0" (issue 45.8)."""
    make_run(primary)
    absent = tmp_path / "not-yet"
    before = tree(primary)
    for dry_run in (["--dry-run"], []):
        result = cli("prune", primary, absent, *dry_run)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (
            f"mirrord: prune: the mirror {absent} does not exist or is not a directory (mirror / --mirror)\n"
        )
    assert not absent.exists() and tree(primary) == before


def test_prune_json_names_what_would_be_and_what_was_deleted(primary: Path, mirror: Path) -> None:
    ckpts = make_run(primary)
    freed = sum(ckpts[s].stat().st_size for s in range(1, 8))
    sync(primary, mirror)
    planned = cli("prune", primary, mirror, "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert (plan["command"], plan["ok"], plan["dry_run"], plan["deleted"]) == ("prune", True, True, [])
    assert sorted((d["volume"], d["step"]) for d in plan["would_delete"]) == sorted(
        (v, s) for v in ("mirror", "primary") for s in range(1, 8)
    )
    assert plan["would_free_bytes"] == {"mirror": freed, "primary": freed}
    assert sorted(k["step"] for k in plan["kept"] if k["volume"] == "mirror") == [8, 9, 10]
    assert steps_on(primary) == steps_on(mirror) == list(range(1, 11))

    done = cli("prune", primary, mirror, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["dry_run"], report["would_delete"], report["freed_bytes"]) == (
        False,
        [],
        {"mirror": freed, "primary": freed},
    )
    assert sorted((d["volume"], d["path"]) for d in report["deleted"]) == sorted(
        (d["volume"], d["path"]) for d in plan["would_delete"]
    )
    assert steps_on(primary) == steps_on(mirror) == [8, 9, 10]

    (mirror / MANIFEST_NAME).write_text("{not json")
    refused = cli("prune", primary, mirror, "--json")
    assert refused.returncode == 1
    assert [r["reason"] for r in json.loads(refused.stdout)["refused"]] == ["manifest"]


def test_disabled_pruning_deletes_nothing_but_dry_run_still_plans(primary: Path, mirror: Path) -> None:
    make_run(primary)
    sync(primary, mirror)
    before = (tree(primary), tree(mirror))
    off = {"MIRRORD_PRUNE__ENABLED": "false"}
    result = cli("prune", primary, mirror, env=off)
    assert result.returncode == 0 and "prune.enabled = false" in result.stdout
    assert "would delete 14 file(s)" in cli("prune", primary, mirror, "--dry-run", env=off).stdout
    assert (tree(primary), tree(mirror)) == before


# -- the Pruner the daemon uses -------------------------------------------------------------------------


@pytest.fixture
def synced(primary: Path, mirror: Path, make_config: Callable[..., Config]) -> Config:
    """Ten real checkpoints mirrored; keep_last = 3 with primary pruning."""
    make_run(primary)
    config = make_config(prune={"keep_last": 3, "primary": True})
    assert mirror_all(config).ok
    return config


def test_a_directory_swapped_for_a_symlink_cannot_redirect_deletions(synced: Config, tmp_path: Path) -> None:
    """Between planning and deleting, each run directory is moved out of its root and replaced by a
    symlink to it: the very files that were planned (same inodes) are then outside the roots, and the
    executor, which never walks through a symlink, deletes none of them."""
    pruner = pruner_for(synced)
    plan = pruner.plan()
    assert len(plan.deletions) == 14
    outside = tmp_path / "outside"
    outside.mkdir()
    for root in (synced.primary, synced.mirror):
        (root / RUN).rename(outside / root.name)
        (root / RUN).symlink_to(outside / root.name, target_is_directory=True)
    report = pruner.run_cycle(plan=plan)
    assert report.deleted == []
    for root in (synced.primary, synced.mirror):
        assert sorted(p.name for p in (outside / root.name).iterdir()) == [f"step_{s:04d}.pt" for s in range(1, 11)]
    assert {s.reason for s in report.skipped} == {"vanished"}
    assert len(Manifest.load(synced.mirror).entries) == 10


def test_a_mirror_listing_error_deletes_nothing(synced: Config, logs: list[dict[str, Any]]) -> None:
    pruner = pruner_for(synced)
    msnap = pruner.mirror.snapshot(synced.patterns)
    msnap = dataclasses.replace(msnap, errors=(f"{synced.mirror}/x: cannot list: Input/output error",))
    before = (tree(synced.primary), tree(synced.mirror))
    report = pruner.run_cycle(mirror_snap=msnap)
    assert not report.ok and report.deleted == []
    assert (tree(synced.primary), tree(synced.mirror)) == before
    assert [e["reason"] for e in logs if e["event"] == "prune.refused"] == ["partial_view"]
    assert pruner.metrics.prune_refused.labels("partial_view")._value.get() == 1


def test_in_flight_is_checked_again_just_before_each_unlink(synced: Config) -> None:
    """A copy queued after planning protects its path: the executor asks in_flight() afresh."""
    busy: set[str] = set()
    pruner = pruner_for(synced, in_flight=lambda: frozenset(busy))
    plan = pruner.plan()
    busy.add(f"{RUN}/step_0001.pt")
    report = pruner.run_cycle(plan=plan)
    assert {(s.volume, s.step, s.reason) for s in report.skipped} == {
        ("primary", 1, "in_flight"),
        ("mirror", 1, "in_flight"),
    }
    assert steps_on(synced.primary) == steps_on(synced.mirror) == [1, 8, 9, 10]
    assert f"{RUN}/step_0001.pt" in Manifest.load(synced.mirror).entries


def test_a_file_replaced_after_planning_is_not_deleted(synced: Config) -> None:
    """The executor deletes only the very file it planned (same inode, size and mtime)."""
    pruner = pruner_for(synced)
    plan = pruner.plan()
    path = synced.mirror / RUN / "step_0002.pt"
    replacement = path.with_name("new.tmp")
    replacement.write_bytes(b"someone else's file")
    os.utime(replacement, (1_600_000_000, 1_600_000_000))
    replacement.replace(path)
    report = pruner.run_cycle(plan=plan)
    assert [(v, rel) for v, rel, _why in report.changed] == [("mirror", f"{RUN}/step_0002.pt")]
    assert path.read_bytes() == b"someone else's file"
    # Its primary file goes all the same: below a verified window, a primary step goes mirrored or not.
    assert ("primary", f"{RUN}/step_0002.pt") in {(d.volume, d.rel) for d in report.deleted}
    assert len(report.deleted) == 13


def test_orphan_temp_files_go_only_when_old_and_not_in_flight(synced: Config) -> None:
    mirror = synced.mirror
    old, fresh, busy = (mirror / RUN / f"step_{s:04d}.pt.part" for s in (11, 12, 13))
    for path in (old, fresh, busy):
        path.write_bytes(b"partial")
    os.utime(old, (1_600_000_000, 1_600_000_000))
    os.utime(busy, (1_600_000_000, 1_600_000_000))
    pruner = pruner_for(synced, in_flight=lambda: frozenset({f"{RUN}/step_0013.pt"}))
    report = pruner.run_cycle()
    assert not old.exists() and fresh.exists() and busy.exists()
    assert {(s.rel, s.reason) for s in report.skipped} == {
        (f"{RUN}/step_0012.pt.part", "recent_mtime"),
        (f"{RUN}/step_0013.pt.part", "in_flight"),
    }


def test_metrics_and_logs_count_every_decision(
    primary: Path, mirror: Path, make_config: Callable[..., Config], logs: list[dict[str, Any]]
) -> None:
    ckpts = make_run(primary)
    os.utime(ckpts[1], (0, 0))
    size = sum(ckpts[s].stat().st_size for s in range(2, 8))
    config = make_config(prune={"keep_last": 3, "primary": True})
    assert mirror_all(config).ok
    metrics = Metrics()
    mirror_vol = LocalMirror(mirror)
    report = Pruner(config, LocalVolume(primary), mirror_vol, mirror_vol.read_manifest(), metrics).run_cycle()
    value = metrics.registry.get_sample_value
    for volume in ("primary", "mirror"):
        assert value("mirrord_pruned_files_total", {"volume": volume}) == 6
        assert value("mirrord_pruned_bytes_total", {"volume": volume}) == size
    assert value("mirrord_prune_skipped_total", {"reason": "zero_mtime"}) == 2
    assert value("mirrord_prune_skipped_total", {"reason": "recent_mtime"}) == 0
    assert report.freed_bytes() == 2 * size
    names = [e["event"] for e in logs if e["event"].startswith("prune.")]
    assert names.count("prune.deleted") == 12 and names.count("prune.skipped") == 2
    assert names[-1] == "prune.finished"


def test_mirror_must_be_a_mount_point_when_configured(primary: Path, mirror: Path, small_tmpfs: Path) -> None:
    """With mirror_must_be_mountpoint = true a plain directory is refused and a real mount is pruned."""
    make_run(primary, range(1, 6))
    for root, must_refuse in ((mirror, True), (small_tmpfs, False)):
        data = settings(
            primary,
            root,
            {
                "mirror_must_be_mountpoint": False,
                "prune": {"keep_last": 3},
                "copy": {"settle_seconds": 0, "free_space_reserve_bytes": 0},
            },
        )
        assert mirror_all(load(data, check_roots=False)).ok
        data["mirror_must_be_mountpoint"] = True
        config = load(data, check_roots=False)
        report = pruner_for(config).run_cycle()
        assert [r for r, _ in report.refused] == (["mirror_unmounted"] if must_refuse else [])
        assert steps_on(root) == ([1, 2, 3, 4, 5] if must_refuse else [3, 4, 5])


# -- making room before a copy ----------------------------------------------------------------------------


def _fill(primary: Path, engine: Engine, steps: range) -> None:
    for s in steps:
        src = primary / RUN / f"step_{s:04d}.pt"
        st = src.stat()
        copy_once(engine, CopyJob(f"{RUN}/step_{s:04d}.pt", st.st_size, st.st_mtime_ns, s, "new"))


def _tmpfs_config(primary: Path, mirror: Path, keep_last: int) -> Config:
    data = settings(primary, mirror, {"copy": {"free_space_reserve_bytes": 0}, "prune": {"keep_last": keep_last}})
    return load(data, check_roots=False)


def _fits(mirror: Path, size: int) -> int:
    free = os.statvfs(mirror).f_bavail * os.statvfs(mirror).f_frsize
    return free // size


def test_make_room_prunes_the_oldest_outside_the_kept_set(
    primary: Path, small_tmpfs: Path, logs: list[dict[str, Any]]
) -> None:
    """On a real 8 MiB tmpfs: when the next copy does not fit, the oldest retired steps go first, just
    enough of them, and the copy then succeeds."""
    ckpts = make_run(primary, range(1, 16), width=192)
    size = ckpts[1].stat().st_size
    n = _fits(small_tmpfs, size)
    assert n >= 5, "the tmpfs should hold several checkpoints"
    config = _tmpfs_config(primary, small_tmpfs, keep_last=3)
    mirror = LocalMirror(small_tmpfs)
    manifest = mirror.read_manifest()
    copying: set[str] = set()
    pruner = Pruner(config, LocalVolume(primary), mirror, manifest, Metrics(), in_flight=lambda: frozenset(copying))
    engine = Engine(config, mirror, manifest, Metrics(), make_room=pruner.make_room)
    _fill(primary, engine, range(1, n + 1))
    copying.add(f"{RUN}/step_{n + 1:04d}.pt")
    _fill(primary, engine, range(n + 1, n + 2))
    assert steps_on(small_tmpfs) == list(range(2, n + 2))
    assert [e["outcome"] for e in logs if e["event"] == "prune.make_room"] == ["enough"]
    assert sorted(manifest.entries) == [f"{RUN}/step_{s:04d}.pt" for s in range(2, n + 2)]
    assert steps_on(primary) == list(range(1, 16))  # making room never touches the primary


def test_make_room_never_deletes_inside_the_kept_set(primary: Path, small_tmpfs: Path) -> None:
    """When only kept checkpoints fill the mirror, nothing is deleted and the copy fails with 'no space'."""
    ckpts = make_run(primary, range(1, 16), width=192)
    n = _fits(small_tmpfs, ckpts[1].stat().st_size)
    config = _tmpfs_config(primary, small_tmpfs, keep_last=15)
    mirror = LocalMirror(small_tmpfs)
    manifest = mirror.read_manifest()
    metrics = Metrics()
    pruner = Pruner(config, LocalVolume(primary), mirror, manifest, metrics)
    engine = Engine(config, mirror, manifest, metrics, make_room=pruner.make_room)
    _fill(primary, engine, range(1, n + 1))
    with pytest.raises(NoSpaceError):
        _fill(primary, engine, range(n + 1, n + 2))
    assert steps_on(small_tmpfs) == list(range(1, n + 1))
    assert metrics.registry.get_sample_value("mirrord_copies_total", {"result": "no_space"}) == 1
    assert metrics.registry.get_sample_value("mirrord_pruned_files_total", {"volume": "mirror"}) == 0
