"""Retention inside the running daemon: both sides end with the same kept steps; guards hold.

A daemon pointed at an existing run copies only what the window keeps (issue 14), so the tests that
prune old steps on both sides mirror them first with a one-shot `mirrord sync` (pruning off). The
daemon also deletes only files it has itself seen unchanged for min_age_seconds (monotonic clock).
"""

from __future__ import annotations

import os
import time

from mirrord.store.manifest import Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.cli import run_mirrord
from tests.support.wait import wait_for


def mirror_everything(primary, mirror):
    """What an earlier mirrord (or a first sync with pruning off) left: every step mirrored and recorded."""
    env = {"MIRRORD_PRUNE__ENABLED": "false", "MIRRORD_COPY__SETTLE_SECONDS": "0"}
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert result.returncode == 0, result.stderr


def steps(root, run="r"):
    return sorted(int(p.stem.split("_")[1]) for p in (root / run).glob("step_*.pt"))


def publish_old(primary, numbers, old):
    """Steps r/step_NNNN.pt written long ago, in step order (mtime old + step)."""
    for step in numbers:
        p = publish_checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
        os.utime(p, (old + step, old + step))


def test_keep_last_3_of_10_on_both_sides_with_guards(tmp_path, daemon_factory):
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    old = time.time() - 3600
    publish_old(primary, range(1, 11), old)
    mirror_everything(primary, mirror)
    d = daemon_factory({"prune": {"enabled": True, "keep_last": 3, "primary": True, "min_age_seconds": 1}}).start()
    wait_for(lambda: steps(mirror) == [8, 9, 10] and steps(primary) == [8, 9, 10], 60, "steps 8-10 on both sides")
    assert sorted(Manifest.load(mirror).entries) == [f"r/step_{s:04d}.pt" for s in (8, 9, 10)]
    # (the counter is raised just after each unlink: the last one may still be on its way)
    wait_for(lambda: d.metric("mirrord_pruned_files_total", 'volume="primary"') == 7, 10, "7 primary deletions counted")
    wait_for(lambda: d.metric("mirrord_pruned_files_total", 'volume="mirror"') == 7, 10, "7 mirror deletions counted")
    assert d.stop() == 0


def test_zero_and_recent_mtimes_survive(tmp_path, daemon_factory):
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    old = time.time() - 3600
    publish_old(primary, range(1, 7), old)
    os.utime(primary / "r" / "step_0002.pt", (0, 0))  # a filesystem that does not know the mtime
    soon = time.time() + 40  # within future_skew_seconds: "recent" for min_age_seconds + 40 s
    for step in (3, 4, 5, 6):  # recent, and in step order (a lower step written later is a rollback)
        os.utime(primary / "r" / f"step_{step:04d}.pt", (soon + step, soon + step))
    mirror_everything(primary, mirror)
    d = daemon_factory({"prune": {"enabled": True, "keep_last": 2, "primary": True, "min_age_seconds": 1}}).start()
    wait_for(lambda: steps(primary) == [2, 3, 4, 5, 6], 30, "old steps pruned, guarded ones kept")
    assert d.events("prune.skipped", reason="zero_mtime", path="r/step_0002.pt")
    assert d.events("prune.skipped", reason="recent_mtime", path="r/step_0003.pt")
    assert d.metric("mirrord_prune_skipped_total", 'reason="zero_mtime"') >= 1
    assert d.stop() == 0


def test_a_copy_in_flight_is_never_deleted(tmp_path, gated_primary, daemon_factory):
    """Step 1 is held half copied at a gate while steps 2 and 3 arrive, are mirrored and put it below the
    kept window, and retention runs on every reconcile: the in-flight guard keeps its temp file and its
    source until the copy is done; step 1 goes once the gate opens."""
    backing, primary, mirror = gated_primary.backing, tmp_path / "primary", tmp_path / "mirror"
    old = time.time() - 3600
    held = publish_checkpoint(backing / "r" / "step_0001.pt", 1, megabytes=24)
    os.utime(held, (old + 1, old + 1))
    gated_primary.stall("step_0001.pt", after=16 * 1024 * 1024)
    d = daemon_factory(
        {
            "prune": {"enabled": True, "keep_last": 2, "primary": True, "min_age_seconds": 1},
            "copy": {"workers": 2},
            "watch": {"rescan_interval_seconds": 0.3},
            "io": {"drop_cache": False},
        }
    ).start()
    part = mirror / "r" / "step_0001.pt.part"
    wait_for(lambda: part.exists() and part.stat().st_size > 0, 90, "the copy of step 1 to start")
    publish_old(backing, (2, 3), old)
    wait_for(lambda: steps(mirror) == [2, 3], 90, "steps 2 and 3 mirrored beside the held copy")
    passes = len(d.events("prune.finished"))
    wait_for(lambda: len(d.events("prune.finished")) >= passes + 2, 90, "two more prune passes")
    # Below the window now (2 and 3 verified), and vetoed on both sides for being in flight.
    assert d.events("prune.skipped", reason="in_flight", path="r/step_0001.pt", volume="primary")
    assert d.events("prune.skipped", reason="in_flight", path="r/step_0001.pt.part", volume="mirror")
    assert held.exists() and part.exists(), "the source or the temp file of a copy in flight was deleted"
    gated_primary.unstall()
    wait_for(lambda: steps(primary) == [2, 3] and steps(mirror) == [2, 3], 90, "step 1 pruned once copied")
    assert d.stop() == 0
    # And from the daemon's own account: step 1 was deleted on the primary only after it was committed.
    names = [
        (e["event"], e.get("volume"))
        for e in d.events()
        if e.get("path") == "r/step_0001.pt" and e["event"] in ("copy.committed", "prune.deleted")
    ]
    assert names.index(("prune.deleted", "primary")) > names.index(("copy.committed", None)), names


def test_pruning_after_a_burst_of_copies_retires_the_steps_the_newest_replaces(tmp_path, daemon_factory):
    """Copies finished: the prune pass (from the mirror's last listing plus the copies since) retires the steps
    the newest verified one replaces."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    d = daemon_factory({"prune": {"enabled": True, "keep_last": 1, "min_age_seconds": 0}}).start()
    wait_for(lambda: steps(mirror) == [1], 60, "step 1 mirrored")
    for step in (2, 3):
        publish_checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
    wait_for(lambda: steps(mirror) == [3], 60, "steps 1 and 2 pruned from the mirror once 3 is verified")
    assert len(d.events("prune.finished")) >= 2
    assert steps(primary) == [1, 2, 3]  # prune.primary = false
    assert d.stop() == 0


def test_a_wiped_primary_restarted_from_scratch_never_costs_the_mirror_its_old_tip(tmp_path, daemon_factory):
    """The daemon runs, keep_last 2, prune.primary: steps 1-4 mirrored, pruned to 3 and 4. The run folder is
    wiped (`rm -rf`) and the job starts again from step 1 in the same folder. While the old tip 4 is the
    newest verified step and gone from the primary, the run is paused (logged once); after three new steps
    are mirrored, the old run's step 4 (its only copy) is still on the mirror. Before: the new low steps
    were the newer branch and retention deleted 3 and 4."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    old = time.time() - 3600
    publish_old(primary, range(1, 5), old)
    mirror_everything(primary, mirror)
    d = daemon_factory(
        {
            "prune": {"enabled": True, "keep_last": 2, "primary": True, "min_age_seconds": 0},
            "watch": {"rescan_interval_seconds": 1},
        }
    ).start()
    wait_for(lambda: steps(mirror) == [3, 4] and steps(primary) == [3, 4], 60, "steps 3 and 4 on both sides")
    for p in (primary / "r").iterdir():
        p.unlink()
    (primary / "r").rmdir()
    d.wait_event("prune.paused", run="r", step=4, timeout=60)
    for step in (1, 2, 3):
        publish_checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
        wait_for(lambda step=step: step in steps(mirror), 60, f"new step {step} mirrored")
        assert 4 in steps(mirror), steps(mirror)
    wait_for(lambda: steps(primary) == [2, 3], 60, "the new run pruned to its window")
    wait_for(lambda: steps(mirror) == [2, 3, 4], 60, "the mirror: the new window and the old tip")
    assert len(d.events("prune.paused")) == 1
    assert [e["step"] for e in d.events("prune.branch_tip_kept", run="r")] == [4]
    assert d.stop() == 0


def _legacy(primary, step, rename):
    """A legacy torch.save (no validator can check it: "unchecked"), by rename from NAME.part or in place."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"step": step, "w": torch.full((64, 64), float(step))}, buf, _use_new_zipfile_serialization=False)
    path = primary / "r" / f"step_{step:04d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if rename:
        part = path.with_name(path.name + ".part")
        part.write_bytes(buf.getvalue())
        part.replace(path)
    else:
        path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])  # the trainer died half-way


def test_an_unchecked_format_committed_by_rename_retires_older_steps_one_written_in_place_does_not(
    tmp_path, daemon_factory
):
    """keep_last 1, prune.primary: legacy torch.save checkpoints (no validator reads them). Committed by a
    rename, step 2 is recorded "renamed" (whole by construction) and retires step 1 on both sides; step 3,
    torn and written in place, is published once it stops changing but retires nothing: step 2 stays."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(
        {
            "prune": {"enabled": True, "keep_last": 1, "primary": True, "min_age_seconds": 0},
            "copy": {"settle_seconds": 0.5},
            "watch": {"rescan_interval_seconds": 1},
        }
    ).start()
    _legacy(primary, 1, rename=True)
    wait_for(lambda: steps(mirror) == [1], 60, "step 1 mirrored")
    _legacy(primary, 2, rename=True)
    wait_for(lambda: steps(mirror) == [2] and steps(primary) == [2], 60, "step 1 retired by the renamed step 2")
    assert Manifest.load(mirror).entries["r/step_0002.pt"].validation == "renamed"
    _legacy(primary, 3, rename=False)
    wait_for(lambda: "r/step_0003.pt" in Manifest.load(mirror).entries, 60, "the torn step 3 published")
    assert Manifest.load(mirror).entries["r/step_0003.pt"].validation == "unchecked"
    done = len(d.events("reconcile.finished"))
    wait_for(lambda: len(d.events("reconcile.finished")) >= done + 2, 60, "two more reconciles")
    assert steps(mirror) == steps(primary) == [2, 3]
    assert d.stop() == 0
