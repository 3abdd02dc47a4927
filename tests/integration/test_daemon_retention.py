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


def test_a_slow_copy_in_flight_is_never_deleted(tmp_path, daemon_factory):
    """Step 1 is being copied (slowly) when steps 2 and 3 arrive and put it below the kept window, while
    retention runs on every reconcile: the in-flight guard keeps its temp file until the copy is done,
    and the source stays; step 1 goes once 2 and 3 are verified."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    old = time.time() - 3600
    slow = publish_checkpoint(primary / "r" / "step_0001.pt", 1, megabytes=60)
    os.utime(slow, (old + 1, old + 1))
    d = daemon_factory({"prune": {"enabled": True, "keep_last": 2, "primary": True, "min_age_seconds": 1},
                        "copy": {"workers": 1}, "watch": {"rescan_interval_seconds": 0.3},
                        "io": {"bandwidth_limit": 15 * 1024 * 1024, "drop_cache": False}}).start()
    part = mirror / "r" / "step_0001.pt.part"
    wait_for(lambda: part.exists(), 90, "the slow copy to start")
    publish_old(primary, (2, 3), old)
    wait_for(lambda: d.events("prune.skipped", reason="in_flight", path="r/step_0001.pt.part"), 90,
             "in-flight veto")

    def copy_done() -> bool:
        """For the whole copy, whatever retention does, the source stays: the source missing while
        the temp file is still there (looked at again after the source, so that a copy that just
        finished and was then pruned is no false alarm) is a deletion in flight."""
        in_flight = part.exists()
        assert not in_flight or slow.exists() or not part.exists(), "the source of a copy in flight was deleted"
        return not in_flight

    wait_for(copy_done, 120, "the slow copy to finish")
    wait_for(lambda: steps(primary) == [2, 3] and steps(mirror) == [2, 3], 60, "step 1 pruned once copied")
    assert d.stop() == 0
    # And from the daemon's own account: step 1 was deleted on the primary only after it was committed.
    names = [(e["event"], e.get("volume")) for e in d.events() if e.get("path") == "r/step_0001.pt"
             and e["event"] in ("copy.committed", "prune.deleted")]
    assert names.index(("prune.deleted", "primary")) > names.index(("copy.committed", None)), names


def test_pruning_after_a_burst_of_copies_plans_from_fresh_listings(tmp_path, daemon_factory):
    """Copies finished: the prune pass plans afresh (it lists both trees; prune.finished says so) and
    retires the steps the newest verified one replaces."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    d = daemon_factory({"prune": {"enabled": True, "keep_last": 1, "min_age_seconds": 0}}).start()
    wait_for(lambda: steps(mirror) == [1], 60, "step 1 mirrored")
    for step in (2, 3):
        publish_checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
    wait_for(lambda: steps(mirror) == [3], 60, "steps 1 and 2 pruned from the mirror once 3 is verified")
    passes = d.events("prune.finished")
    assert len(passes) >= 2 and any(p["listed"] for p in passes), passes
    assert steps(primary) == [1, 2, 3]  # prune.primary = false
    assert d.stop() == 0
