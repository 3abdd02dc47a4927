"""`mirrord run` as a real process: watcher, reconciler, workers, signals, restarts."""

from __future__ import annotations

import filecmp
import itertools
import math
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from mirrord.store.manifest import Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for


def mirrored(mirror: Path, rel: str) -> bool:
    return rel in Manifest.load(mirror).entries and (mirror / rel).exists()


def no_parts(root: Path) -> bool:
    return not list(root.rglob("*.part"))


def test_renamed_checkpoint_is_mirrored_and_recorded(tmp_path, daemon_factory):
    """A checkpoint committed by .part -> rename appears on the mirror, whole, and in the manifest."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory().start()
    src = publish_checkpoint(primary / "run1" / "step_0010.pt", 10, megabytes=2)
    wait_for(lambda: mirrored(mirror, "run1/step_0010.pt"), 90, "step 10 mirrored")
    assert filecmp.cmp(src, mirror / "run1/step_0010.pt", shallow=False)
    entry = Manifest.load(mirror).entries["run1/step_0010.pt"]
    assert entry.size == src.stat().st_size and entry.step == 10 and entry.algo == "blake3"
    assert (mirror / "run1/step_0010.pt").stat().st_mtime_ns == src.stat().st_mtime_ns
    assert d.metric("mirrord_copies_total", 'result="ok"') == 1
    assert d.stop() == 0
    assert no_parts(mirror)


def test_an_unverifiable_format_is_mirrored_unchecked_and_the_log_says_why(tmp_path, daemon_factory):
    """A legacy torch.save file has no checksums: it is mirrored, recorded as committed by its rename (no
    validator vouches for its bytes, the rename is the evidence of wholeness), and copy.committed tells the
    user what it is and how to make it verifiable."""
    import torch

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    part = primary / "run1" / "step_0005.pt.part"
    part.parent.mkdir(parents=True)  # before the start: watched from the start, so the rename is seen as one
    d = daemon_factory().start()
    torch.save({"w": torch.ones(64)}, part, _use_new_zipfile_serialization=False)
    part.rename(primary / "run1" / "step_0005.pt")
    wait_for(lambda: mirrored(mirror, "run1/step_0005.pt"), 90, "step 5 mirrored")
    assert Manifest.load(mirror).entries["run1/step_0005.pt"].validation == "renamed"
    event = d.wait_event("copy.committed", 30)
    assert event["validation"] == "unchecked"  # the validator's own verdict, said with why
    assert "legacy torch.save format" in event["validation_detail"]
    assert d.stop() == 0


def iso_seconds(timestamp: str) -> float:
    """A log event's ISO-8601 UTC timestamp as seconds since the epoch (no local time zone involved)."""
    return datetime.fromisoformat(timestamp).timestamp()


def test_iso_seconds_is_independent_of_the_local_time_zone(monkeypatch):
    """2026-07-01 in Berlin is UTC+2 (daylight saving time): the conversion must not care."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        assert iso_seconds("2026-07-01T12:00:00.250000Z") == 1_782_907_200.25
        assert iso_seconds("2026-01-01T12:00:00Z") == 1_767_268_800.0
    finally:
        monkeypatch.undo()
        time.tzset()


def test_in_place_writer_is_copied_only_after_it_settles(tmp_path, daemon_factory):
    """A file written in place, slowly, is copied only once it has been quiet for settle_seconds, and
    the mirror ends with the final file. A copy may start before the writer finished only if the writer
    really paused for settle_seconds (a loaded machine can stall it), and then it must not be the last."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    settle = 1.0
    d = daemon_factory({"copy": {"settle_seconds": settle}}).start()
    target = primary / "step_0005.pt"
    writes: list[tuple[float, float]] = []  # (start, end) of each write, wall clock like the log

    with target.open("wb") as f:
        for _ in range(12):
            began = time.time()
            f.write(os.urandom(256 * 1024))
            f.flush()
            writes.append((began, time.time()))
            time.sleep(0.2)  # pacing of a slow writer, not synchronization
    done_at = writes[-1][1]
    final_size = target.stat().st_size

    def final_version_mirrored() -> bool:
        entry = Manifest.load(mirror).entries.get("step_0005.pt")
        return entry is not None and entry.size == final_size and (mirror / "step_0005.pt").exists()

    wait_for(final_version_mirrored, 60, "the final version mirrored")
    assert filecmp.cmp(target, mirror / "step_0005.pt", shallow=False)
    commits = d.events("copy.committed", path="step_0005.pt")
    assert commits and commits[-1]["size"] == final_size
    for started in d.events("copy.started", path="step_0005.pt"):
        at = iso_seconds(started["timestamp"])
        if at >= done_at:
            continue
        # The writer's pauses before the copy started (the last one ends at the start itself).
        quiet = [
            min(nxt[0], at) - prev[1]
            for prev, nxt in itertools.pairwise([*writes, (math.inf, math.inf)])
            if prev[1] < at
        ]
        assert max(quiet, default=0.0) >= settle - 0.1, (
            f"copy started {done_at - at:.2f} s before the writer finished, which never paused for "
            f"{settle} s (longest pause {max(quiet, default=0.0):.2f} s)"
        )
    assert d.stop() == 0


def test_files_committed_while_stopped_are_mirrored_at_start(tmp_path, daemon_factory):
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step in (1, 2, 3):
        publish_checkpoint(primary / "runA" / f"step_{step:04d}.pt", step)
    # One worker: with two, the second job's copy.started may be logged first (threads race to the log).
    d = daemon_factory({"copy": {"workers": 1}}).start()
    wait_for(lambda: all(mirrored(mirror, f"runA/step_{s:04d}.pt") for s in (1, 2, 3)), 90, "start-up copies")
    order = [e["step"] for e in d.events("copy.started")]
    assert order == [3, 2, 1], f"newest step must be copied first, got {order}"
    assert d.stop() == 0


def test_lost_events_are_repaired_by_the_rescan(tmp_path, daemon_factory):
    """With polling so slow that events never arrive in time, the periodic reconcile still mirrors."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(
        {"watch": {"mode": "polling", "poll_interval_seconds": 3600, "rescan_interval_seconds": 1.0}}
    ).start()
    d.wait_event("watch.mode", mode="polling")
    publish_checkpoint(primary / "step_0042.pt", 42)
    wait_for(lambda: mirrored(mirror, "step_0042.pt"), 90, "rescan mirrors the file")
    # Found by a reconcile (first sight: unsettled, then queued by the settle recheck), not an event.
    assert any(e["queued"] >= 1 or e["unsettled"] >= 1 for e in d.events("reconcile.finished"))
    assert d.stop() == 0


def test_kill_9_during_a_large_copy_then_restart_completes_it(tmp_path, gated_primary, daemon_factory):
    """A copy held half done at a gate is killed with SIGKILL: no final name; a restart completes it."""
    mirror = tmp_path / "mirror"
    src = publish_checkpoint(gated_primary.backing / "big" / "step_0100.pt", 100, megabytes=40)
    gated_primary.stall("step_0100.pt", after=20 * 1024 * 1024)
    slow = daemon_factory({"io": {"drop_cache": False}}).start()
    part = mirror / "big" / "step_0100.pt.part"
    wait_for(lambda: part.exists() and part.stat().st_size > 10 * 1024 * 1024, 90, "copy in progress")
    slow.stop(signal.SIGKILL)
    gated_primary.unstall()
    assert not (mirror / "big" / "step_0100.pt").exists(), "a killed copy must leave no final name"
    assert part.exists()  # the dead process's temp file, to be replaced by the next copy
    fresh = daemon_factory().start()
    wait_for(lambda: mirrored(mirror, "big/step_0100.pt"), 60, "copy completed after restart")
    assert filecmp.cmp(src, mirror / "big/step_0100.pt", shallow=False)
    assert no_parts(mirror)
    assert fresh.stop() == 0


def test_sigterm_during_a_copy_exits_0_within_grace_leaving_no_trace(tmp_path, gated_primary, daemon_factory):
    """A copy held half done at a gate outlasts the 1 s grace of a SIGTERM: the daemon cancels it (no final
    name, no temp file) instead of waiting for it, and exits 0. The gate opens once the cancel is asked."""
    mirror = tmp_path / "mirror"
    publish_checkpoint(gated_primary.backing / "step_0007.pt", 7, megabytes=40)
    gated_primary.stall("step_0007.pt", after=20 * 1024 * 1024)
    d = daemon_factory({"io": {"drop_cache": False}, "daemon": {"shutdown_grace_seconds": 1.0}}).start()
    part = mirror / "step_0007.pt.part"
    wait_for(lambda: part.exists() and part.stat().st_size > 10 * 1024 * 1024, 90, "copy in progress")
    d.send(signal.SIGTERM)
    d.wait_event("stop.cancelling_copies", copies=1, why="shutdown grace period (1 s) over")
    gated_primary.unstall()
    assert d.proc is not None
    assert d.proc.wait(timeout=90) == 0
    assert not (mirror / "step_0007.pt").exists(), "the daemon waited for the copy instead of cancelling it"
    assert not d.events("copy.committed", path="step_0007.pt")
    assert d.events("copy.aborted", path="step_0007.pt")
    assert no_parts(mirror)
    assert d.events("daemon.stopped")


def test_on_a_hung_mount_a_stalled_copy_is_replaced_once_per_worker_not_at_every_stall(
    tmp_path, gated_primary, daemon_factory
):
    """Every read of a checkpoint hangs (a hung mount, held at the gate): its copy stalls, the fresh worker's
    retry stalls too and is not replaced (one worker: two copy threads at most, not one more every
    stall_seconds), and /healthz says so. Once the reads flow again, the file is copied and all is well."""
    mirror = tmp_path / "mirror"
    src = publish_checkpoint(gated_primary.backing / "step_0001.pt", 1)
    gated_primary.stall("step_0001.pt")
    d = daemon_factory({"copy": {"workers": 1, "stall_seconds": 1.0}}).start()
    try:
        d.wait_event("worker.not_replaced", timeout=90)
        beats = len(d.events("daemon.unhealthy"))
        wait_for(lambda: len(d.events("daemon.unhealthy")) >= beats + 20, 90, "5 stall periods of heartbeats")
        assert len(d.events("copy.stalled")) == 2
        code, why = d.http("/healthz")
        assert code == 503 and "1 copy worker(s) not replaced" in why
    finally:
        gated_primary.unstall()
    wait_for(lambda: mirrored(mirror, "step_0001.pt"), 90, "the copy once the reads flow")
    assert filecmp.cmp(src, mirror / "step_0001.pt", shallow=False) and no_parts(mirror)
    wait_for(lambda: d.http("/healthz")[0] == 200, 90, "a healthy daemon")
    assert d.stop() == 0


def test_sighup_reloads_workers_and_rejects_a_bad_config(tmp_path, daemon_factory):
    d = daemon_factory().start()
    d.settings["copy"]["workers"] = 3
    d.write_config()
    d.send(signal.SIGHUP)
    d.wait_event("config.reloaded", workers=3)
    d.settings["copy"]["workers"] = 0
    d.write_config()
    d.send(signal.SIGHUP)
    failed = d.wait_event("config.reload_failed")
    assert any("copy.workers" in p for p in failed["problems"])
    d.settings["mirror"] = str(tmp_path / "elsewhere")
    d.settings["copy"]["workers"] = 2
    d.write_config()
    d.send(signal.SIGHUP)
    assert "mirror" in d.wait_event("config.reload_refused")["keys"]
    assert d.http("/healthz")[0] == 200
    assert d.stop() == 0


def test_busy_metrics_address_fails_start_up_naming_it(tmp_path, daemon_factory):
    first = daemon_factory().start()
    second = daemon_factory(
        {"metrics": {"address": f"127.0.0.1:{first.port}"}, "mirror": str(tmp_path / "other-mirror")}
    )
    second.start(wait_ready=False)
    assert second.proc is not None
    assert second.proc.wait(timeout=30) == 2
    assert f"127.0.0.1:{first.port}" in second.log_text() and "metrics.address" in second.log_text()
    assert first.stop() == 0


def test_second_daemon_on_the_same_mirror_is_refused(tmp_path, daemon_factory):
    first = daemon_factory().start()
    second = daemon_factory()
    second.start(wait_ready=False)
    assert second.proc is not None
    assert second.proc.wait(timeout=30) == 1
    assert "another mirrord process" in second.log_text()
    assert first.stop() == 0


def _inotify_watches(limit: int) -> list[str]:
    """A wrapper that runs the daemon in a user namespace of its own whose inotify watch limit is `limit`:
    the limit runs out for the daemon alone. (Lowering fs.inotify.max_user_watches instead reaches every
    process on the host: other tests' daemons lost the events of the folders made meanwhile.)"""
    script = f'echo {limit} > /proc/sys/user/max_inotify_watches && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh"]


def _can_limit_inotify() -> bool:
    probe = subprocess.run([*_inotify_watches(1), "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_userns_limit = pytest.mark.skipif(
    not _can_limit_inotify(), reason="needs unshare --user and a per-namespace inotify limit (/proc/sys/user)"
)


@needs_userns_limit
def test_inotify_watch_limit_falls_back_to_polling(tmp_path, daemon_factory):
    """inotify cannot watch the primary (the watch limit is exhausted): the daemon says why and polls instead."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for i in range(8):
        (primary / f"run{i}").mkdir()
    d = daemon_factory({"watch": {"poll_interval_seconds": 0.2}}, wrapper=_inotify_watches(0)).start()
    d.wait_event("watch.mode", mode="polling")
    failed = d.events("watch.native_failed")
    assert failed and failed[0]["fallback"] == "polling"
    publish_checkpoint(primary / "run5" / "step_0001.pt", 1)
    wait_for(lambda: mirrored(mirror, "run5/step_0001.pt"), 90, "mirrored by the polling watcher")
    assert d.stop() == 0


@needs_userns_limit
def test_a_folder_inotify_cannot_watch_turns_the_watch_to_polling(tmp_path, daemon_factory):
    """The watch limit runs out only later, at a folder the trainer makes: watchdog skips that folder
    and its files would send no events (the periodic rescan, an hour away here, was the only way they were
    found). The daemon sees the failed inotify_add_watch, says which folder, polls from then on and
    rescans at once."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "run1").mkdir()
    d = daemon_factory(
        {"watch": {"poll_interval_seconds": 0.2, "rescan_interval_seconds": 3600}}, wrapper=_inotify_watches(2)
    ).start()  # the primary and run1: no watch left
    d.wait_event("watch.mode", mode="native")
    publish_checkpoint(primary / "run1" / "step_0001.pt", 1)
    wait_for(lambda: mirrored(mirror, "run1/step_0001.pt"), 90, "mirrored from its events")
    publish_checkpoint(primary / "run2" / "step_0002.pt", 2)  # a new folder: inotify cannot watch it
    failed = d.wait_event("watch.native_failed")
    assert "run2" in failed["cause"] and failed["fallback"] == "polling", failed
    d.wait_event("watch.mode", mode="polling")
    wait_for(lambda: mirrored(mirror, "run2/step_0002.pt"), 90, "the unwatched folder's checkpoint mirrored")
    publish_checkpoint(primary / "run3" / "step_0003.pt", 3)
    wait_for(lambda: mirrored(mirror, "run3/step_0003.pt"), 90, "mirrored by the polling watcher")
    assert d.metric("mirrord_watch_mode", 'mode="polling"') == 1
    assert d.metric("mirrord_watch_mode", 'mode="native"') == 0
    assert d.stop() == 0
