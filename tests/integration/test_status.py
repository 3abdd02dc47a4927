"""`mirrord status` as a person (and a script) runs it: the real CLI over real mirrors, with and without a daemon."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from mirrord.commands.status import collect
from mirrord.config import load_config
from mirrord.store.manifest import MANIFEST_NAME, Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_port
from tests.support.wait import wait_for


@pytest.fixture
def no_daemon_env() -> dict[str, str]:
    """A metrics address where certainly nothing listens, so "no daemon" is what the test sees."""
    return {"MIRRORD_METRICS__ADDRESS": f"127.0.0.1:{free_port()}"}


def status(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    result = run_mirrord("status", "--json", *args, env=env)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def only_the_daemon_is_missing(code: int, report: dict[str, Any]) -> bool:
    """No daemon answering is itself a problem (exit 1), and here the only one."""
    return code == 1 and len(report["problems"]) == 1 and report["problems"][0].startswith("daemon: nothing answers")


def run_of(report: dict[str, Any], name: str) -> dict[str, Any]:
    [run] = [r for r in report["runs"] if r["run"] == name]
    return run


def sync(primary: Path, mirror: Path, env: dict[str, str] | None = None) -> None:
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert result.returncode == 0, result.stderr


def test_per_run_steps_lag_and_free_space_without_a_daemon(primary, mirror, checkpoint, no_daemon_env) -> None:
    """Each run shows its newest step on both sides; an unmirrored step is lag, not a problem."""
    for step in (1, 2):
        checkpoint(primary / "runA" / f"step_{step:04d}.pt", step)
    checkpoint(primary / "runB" / "step_0005.pt", 5)
    sync(primary, mirror)
    # Committed a minute ago, after the last sync: lag within --max-lag (15 min by default).
    checkpoint(primary / "runA" / "step_0003.pt", 3, mtime_ns=time.time_ns() - 60 * 10**9)

    code, report = status("--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert only_the_daemon_is_missing(code, report), report["problems"]
    assert report["command"] == "status"
    a, b = run_of(report, "runA"), run_of(report, "runB")
    assert (a["primary_step"], a["mirror_step"], a["verified"], a["pending_files"]) == (3, 2, True, 1)
    assert a["lag_seconds"] > 0 and report["lag_seconds"] == a["lag_seconds"]
    assert (b["primary_step"], b["mirror_step"], b["verified"], b["pending_files"], b["lag_seconds"]) == (
        5,
        5,
        True,
        0,
        0.0,
    )
    assert a["verify_mode"] == "size"
    for side in ("primary", "mirror"):
        assert 0 < report[side]["free_bytes"] <= report[side]["total_bytes"]
    assert report["mirror"]["files"] == report["manifest_entries"] == 3
    assert report["daemon"]["running"] is False
    assert no_daemon_env["MIRRORD_METRICS__ADDRESS"] in report["daemon"]["error"]

    text = run_mirrord("status", "--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert text.returncode == 1
    lines = text.stdout.splitlines()
    [row_a] = [line for line in lines if line.strip().startswith("runA ")]
    assert row_a.split()[:3] == ["runA", "3", "2"] and "1 file(s), oldest" in row_a
    [row_b] = [line for line in lines if line.strip().startswith("runB ")]
    assert "intact (size checked)" in row_b and row_b.rstrip().endswith("caught up")
    assert "free of" in text.stdout
    assert "daemon   not reachable" in text.stdout
    assert "problems:\n  ! daemon: nothing answers on" in text.stdout  # never "problems: none"


def test_size_check_by_default_hash_check_with_verify(primary, mirror, checkpoint, no_daemon_env) -> None:
    """Bit rot keeps the size: only --verify (which reads the file) sees it; exit 1 once it is seen."""
    for step in (1, 2):
        checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
    sync(primary, mirror)
    newest = mirror / "r" / "step_0002.pt"
    mtime_ns = newest.stat().st_mtime_ns
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    os.utime(newest, ns=(mtime_ns, mtime_ns))  # bit rot changes no metadata

    code, report = status("--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert only_the_daemon_is_missing(code, report) and run_of(report, "r")["verified"] is True

    code, report = status("--verify", "--primary", primary, "--mirror", mirror, env=no_daemon_env)
    r = run_of(report, "r")
    assert code == 1 and not report["ok"]
    assert (r["verified"], r["verify_mode"]) == (False, "hash")
    assert "hash_mismatch" in r["verify_detail"] and "r/step_0002.pt" in r["verify_detail"]
    assert any("NOT intact" in p for p in report["problems"])


def test_truncated_newest_copy_fails_the_size_check(primary, mirror, checkpoint, no_daemon_env) -> None:
    """A truncated file on the mirror is caught without reading it, and shown as NOT INTACT."""
    checkpoint(primary / "r" / "step_0007.pt", 7)
    sync(primary, mirror)
    with (mirror / "r" / "step_0007.pt").open("r+b") as f:
        f.truncate(100)
    result = run_mirrord("status", "--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert result.returncode == 1
    assert "NOT INTACT (size)" in result.stdout
    assert "r/step_0007.pt: 100 bytes, manifest says" in result.stdout
    assert "differ in size from the manifest" in result.stdout


def test_an_emptied_mirror_is_reported_as_probably_unmounted(primary, mirror, checkpoint, no_daemon_env) -> None:
    """Manifest entries with no files behind them: the mirror volume is probably not mounted."""
    checkpoint(primary / "r" / "step_0001.pt", 1)
    sync(primary, mirror)
    shutil.rmtree(mirror / "r")
    code, report = status("--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert code == 1
    assert any("is empty but its manifest lists 1 file(s)" in p for p in report["problems"])
    assert run_of(report, "r")["verified"] is False


def test_an_unreadable_manifest_is_a_problem(primary, mirror, checkpoint, no_daemon_env) -> None:
    """A corrupt manifest vouches for nothing: reported, and every mirrored file shows as unrecorded."""
    checkpoint(primary / "r" / "step_0001.pt", 1)
    sync(primary, mirror)
    (mirror / MANIFEST_NAME).write_text("{not json")
    code, report = status("--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert code == 1
    assert any(p.startswith("manifest: cannot parse manifest") for p in report["problems"])
    assert any("not in the manifest" in n for n in report["notes"])


def test_steps_retention_let_go_are_not_lag(primary, mirror, checkpoint, no_daemon_env) -> None:
    """With pruning on and the primary kept, old steps absent from the mirror are retired, not behind."""
    for step in (1, 2, 3, 4):
        checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
    env = {**no_daemon_env, "MIRRORD_PRUNE__KEEP_LAST": "2", "MIRRORD_PRUNE__MIN_AGE_SECONDS": "0"}
    sync(primary, mirror, env)
    pruned = run_mirrord("prune", "--primary", primary, "--mirror", mirror, env=env)
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert sorted(Manifest.load(mirror).entries) == ["r/step_0003.pt", "r/step_0004.pt"]

    code, report = status("--primary", primary, "--mirror", mirror, env=env)
    r = run_of(report, "r")
    assert only_the_daemon_is_missing(code, report)
    assert (r["primary_step"], r["mirror_step"], r["pending_files"], r["lag_seconds"]) == (4, 4, 0, 0.0)
    # Without retention the same two steps are simply missing from the mirror: that is lag.
    _, report = status("--primary", primary, "--mirror", mirror, env={**env, "MIRRORD_PRUNE__ENABLED": "false"})
    assert run_of(report, "r")["pending_files"] == 2


def test_no_manifest_and_checkpoints_an_hour_behind_is_a_problem(primary, mirror, checkpoint, no_daemon_env) -> None:
    """Nothing mirrored, no daemon, every checkpoint an hour old: two problems, exit 1, not "problems: none".
    (metrics.enabled = false: that no daemon answers is then a note, not a third problem.)"""
    no_daemon_env = {**no_daemon_env, "MIRRORD_METRICS__ENABLED": "false"}
    hour_ago = time.time_ns() - 3600 * 10**9
    for step in (1, 2):
        checkpoint(primary / "r" / f"step_{step:04d}.pt", step, mtime_ns=hour_ago + step)
    args = ("--primary", primary, "--mirror", mirror)
    code, report = status(*args, env=no_daemon_env)
    assert code == 1 and not report["ok"]
    assert any(p.startswith("mirror: no manifest") and "none of the 2 checkpoint(s)" in p for p in report["problems"])
    assert any(p.startswith("run r: the mirror is 1h 00m behind") for p in report["problems"])
    text = run_mirrord("status", *args, env=no_daemon_env)
    assert text.returncode == 1 and "problems: none" not in text.stdout
    # Within --max-lag only the missing manifest is wrong; once synced, nothing is.
    code, report = status(*args, "--max-lag", "7200", env=no_daemon_env)
    assert code == 1 and [p.split(":")[0] for p in report["problems"]] == ["mirror"]
    sync(primary, mirror)
    assert status(*args, env=no_daemon_env)[0] == 0


def test_lag_beyond_max_lag_is_a_problem_with_a_manifest_too(primary, mirror, checkpoint, no_daemon_env) -> None:
    no_daemon_env = {**no_daemon_env, "MIRRORD_METRICS__ENABLED": "false"}  # no daemon to ask: a note
    checkpoint(primary / "r" / "step_0001.pt", 1)
    sync(primary, mirror)
    checkpoint(primary / "r" / "step_0002.pt", 2, mtime_ns=time.time_ns() - 1200 * 10**9)  # 20 min ago
    args = ("--primary", primary, "--mirror", mirror)
    code, report = status(*args, env=no_daemon_env)
    [problem] = report["problems"]
    assert code == 1 and problem.startswith("run r: the mirror is 20m ")
    assert problem.endswith("behind (1 file(s) not mirrored; more than 15m 00s, see --max-lag)")
    code, report = status(*args, "--max-lag", "3600", env=no_daemon_env)
    assert (code, report["problems"], run_of(report, "r")["pending_files"]) == (0, [], 1)


def test_step_columns_say_they_are_steps(primary, mirror, checkpoint, no_daemon_env) -> None:
    no_daemon_env = {**no_daemon_env, "MIRRORD_METRICS__ENABLED": "false"}  # no daemon to ask: a note
    checkpoint(primary / "r" / "step_0007.pt", 7)
    sync(primary, mirror)
    result = run_mirrord("status", "--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert result.returncode == 0, result.stdout
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("RUN"))
    assert "NEWEST STEP (PRIMARY)" in header and "NEWEST STEP (MIRROR)" in header
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("r "))
    assert row.split()[:3] == ["r", "7", "7"]


def test_a_running_daemon_is_asked_for_health_queue_and_copies(tmp_path, daemon_factory) -> None:
    """With the daemon up, status shows its health, readiness, queue and copy counts from its endpoint."""
    primary = tmp_path / "primary"
    d: DaemonProcess = daemon_factory().start()
    publish_checkpoint(primary / "live" / "step_0003.pt", 3)
    wait_for(lambda: d.metric("mirrord_copies_total", 'result="ok"') == 1, 90, "one copy counted")
    # The queue gauge is refreshed by the heartbeat: wait for the one after the copy.
    wait_for(lambda: d.metric("mirrord_queue_depth") == 0, 90, "queue gauge back to 0")

    code, body = d.http("/status")  # all that status asks the daemon, in one document
    said = json.loads(body)
    assert code == 200 and (said["primary"], said["mirror"]) == (str(primary), str(tmp_path / "mirror"))
    assert (said["healthy"], said["health"], said["ready"], said["readiness"]) == (True, "ok", True, "ready")
    assert said["copies_by_result"]["ok"] == 1 and said["in_flight"] == 0 and said["last_copy_at"] > 0

    code, report = status("--config", d.config_path)
    daemon = report["daemon"]
    assert code == 0 and report["ok"]
    assert (daemon["running"], daemon["healthy"], daemon["ready"]) == (True, True, True)
    assert (daemon["health"], daemon["readiness"]) == ("ok", "ready")
    assert daemon["copies"]["ok"] == 1 and daemon["copies"]["failed"] == 0
    assert daemon["queue_depth"] == 0 and daemon["in_flight"] == 0
    assert daemon["version"] == report["version"]
    assert daemon["last_copy_at"] > 0
    live = run_of(report, "live")
    assert (live["primary_step"], live["mirror_step"], live["verified"], live["pending_files"]) == (3, 3, True, 0)

    text = run_mirrord("status", "--verify", "--config", d.config_path)
    assert text.returncode == 0, text.stdout
    assert f"on 127.0.0.1:{d.port}: healthy, ready" in text.stdout
    assert "copies since start: 1 ok" in text.stdout
    assert "intact (hash checked)" in text.stdout
    assert d.stop() == 0


def test_a_daemon_refusing_the_mirror_makes_status_fail_with_its_reason(tmp_path, daemon_factory) -> None:
    """The daemon's own /readyz reason reaches the person running status, next to what the disk shows."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "run1" / "step_0001.pt", 1)
    first = daemon_factory().start()
    wait_for(
        lambda: (mirror / "run1" / "step_0001.pt").exists() and Manifest.load(mirror).entries, 20, "step 1 mirrored"
    )
    assert first.stop() == 0
    shutil.rmtree(mirror / "run1")
    again = daemon_factory().start(wait_ready=False)
    wait_for(lambda: again.http("/readyz")[0] == 503, 90, "/readyz 503")

    code, report = status("--config", again.config_path)
    assert code == 1
    assert report["daemon"]["running"] and report["daemon"]["healthy"] and not report["daemon"]["ready"]
    assert any(p.startswith("daemon: not ready:") and "manifest lists 1 file" in p for p in report["problems"])
    assert any(p.startswith("mirror:") and "is empty but its manifest lists" in p for p in report["problems"])
    assert again.stop() == 0


def test_status_help_is_complete() -> None:
    """--help names every option and the exit codes."""
    result = run_mirrord("status", "--help")
    assert result.returncode == 0
    for text in ("--json", "--verify", "--timeout", "--config", "--primary", "--mirror", "Exit 0"):
        assert text in result.stdout, text


def test_status_during_copies_and_pruning_reports_no_false_damage(tmp_path, gated_primary, daemon_factory) -> None:
    """While the daemon publishes, records and prunes, no status taken meanwhile reports damage on disk.
    Each copy is held half done at a gate while statuses are taken, then released."""
    backing, mirror = gated_primary.backing, tmp_path / "mirror"
    d: DaemonProcess = daemon_factory(
        {
            "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 0, "primary": True},
            "watch": {"rescan_interval_seconds": 0.3},
            "io": {"drop_cache": False},
        }
    ).start()
    config = load_config(d.config_path, environ={})
    reports = []

    def look() -> None:
        reports.append(collect(config))

    def finished() -> bool:
        look()
        return sorted(Manifest.load(mirror).entries) == ["r/step_0009.pt", "r/step_0010.pt"] and not any(
            mirror.rglob("*.part")
        )

    def mirrored(rel: str) -> bool:
        look()
        return rel in Manifest.load(mirror).entries

    for step in range(1, 11):
        # Each step mirrored before the next is written, so that older ones are copied and then pruned
        # (a step already below the window when first seen is never copied at all).
        rel = f"r/step_{step:04d}.pt"
        gated_primary.stall(Path(rel).name, after=12 * 2**20)
        publish_checkpoint(backing / rel, step, megabytes=16)
        wait_for(lambda rel=rel: d.events("copy.started", path=rel), 60, f"{rel} held in flight")
        for _ in range(3):
            look()
        gated_primary.unstall()
        wait_for(lambda rel=rel: mirrored(rel), 60, f"{rel} mirrored", interval=0)
    wait_for(finished, 90, "steps 9 and 10 kept, the rest pruned", interval=0)  # as many looks as possible
    assert len(reports) > 30
    # Only what status concludes from the disks; the daemon's own health is another test's business.
    assert [p for r in reports for p in r.problems if not p.startswith("daemon:")] == []
    assert d.metric("mirrord_pruned_files_total", 'volume="mirror"') >= 1
    assert d.metric("mirrord_pruned_files_total", 'volume="primary"') >= 1
    assert d.stop() == 0


def test_status_does_not_take_another_mirrors_daemon_for_its_own(tmp_path, daemon_factory) -> None:
    """Two configs share one metrics address: the second daemon cannot start, and `status` for the second
    mirror must not report the first daemon as its own (healthy, ready): the daemon says which roots it
    mirrors, status compares, and says this config's daemon is not running."""
    first: DaemonProcess = daemon_factory().start()
    other = tmp_path / "other"
    (other / "primary").mkdir(parents=True)
    (other / "mirror").mkdir()
    second = DaemonProcess(
        other, other / "primary", other / "mirror", {"metrics": {"address": f"127.0.0.1:{first.port}"}}
    )
    try:
        second.start(wait_ready=False)
        wait_for(second.exited, 60, "the second daemon's refusal (its address is taken)")
        assert second.proc is not None and second.proc.returncode == 2
    finally:
        second.kill()
    code, report = status("--config", second.config_path)
    assert code == 1 and not report["daemon"]["running"]
    [problem] = [p for p in report["problems"] if p.startswith("daemon:")]
    assert "another mirror" in problem and str(tmp_path / "mirror") in problem
    code, report = status("--config", first.config_path)  # the first config still finds its own daemon
    assert code == 0 and report["daemon"]["running"] and report["daemon"]["healthy"]
    assert first.stop() == 0


def test_run_names_are_escaped_on_the_terminal(primary, mirror, no_daemon_env) -> None:
    """A user who can create a run folder must not reach the admin's terminal through `status`: a name
    setting the window title, writing the clipboard (OSC 52) or clearing the screen is printed escaped."""
    hostile = "run\x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\u202egnp"
    publish_checkpoint(primary / hostile / "step_0001.pt", 1)
    result = run_mirrord("status", "--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert result.returncode in (0, 1), result.stderr
    assert not any(c in result.stdout for c in "\x1b\x07\u202e")
    assert "run\\x1b]0;owned\\x07\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\u202egnp" in result.stdout
    _code, report = status("--primary", primary, "--mirror", mirror, env=no_daemon_env)
    assert hostile in [r["run"] for r in report["runs"]]  # --json keeps the name exact (JSON escapes it)
