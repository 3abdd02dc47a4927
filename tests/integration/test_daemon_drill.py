"""The daemon's drill (issue 43): once a run's newest checkpoint is mirrored and the copies are done, a real daemon
restores it into the mirror's staging area and loads it in a bounded child process; the real /metrics, the log and
`mirrord status` say how it went, no scratch copy is left, and a unit is drilled again only after the interval; a
real Prometheus scraping it fires MirrordDrillFailing for the failing run, and resolves it once a drill of it passes."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_prometheus_e2e import ALERT_RULES, PrometheusServer
from tests.support.checkpoints import publish_checkpoint, save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.wait import wait_for

DRILL_SECONDS = 120  # a loader that imports torch on a loaded machine
# A sitecustomize that holds the drill's loader (not the daemon) once started: its pid in $DRILL_STARTED, then it
# opens the FIFO $DRILL_GATE, which no one ever opens for writing.
HOLD_LOADER = """
import os, sys
if "mirrord.formats.loader" in sys.orig_argv:
    open(os.environ["DRILL_STARTED"] + ".part", "w").write(str(os.getpid()))
    os.replace(os.environ["DRILL_STARTED"] + ".part", os.environ["DRILL_STARTED"])
    open(os.environ["DRILL_GATE"]).read()
"""
IOPRIO_GET = {"x86_64": 252, "aarch64": 31}


class Custom:
    """A class of the trainer's own: torch.save pickles it, torch.load(weights_only=True) refuses it."""


def test_the_daemon_drills_each_runs_newest_checkpoint_once_mirrored(
    tmp_path: Path, daemon_factory: Any, request: pytest.FixtureRequest
) -> None:
    """Run `bad` (bytes as recorded, a pickle weights_only refuses) fails with torch's message naming the mirror file;
    run `good`, saved after that, passes as soon as it is mirrored, and `bad` was not drilled again meanwhile (within
    the interval); a real Prometheus fires MirrordDrillFailing for `bad` only, and resolves it once a newer checkpoint
    of `bad` passes; `good` is drilled again once a reload shortens the interval. A scratch folder a killed drill
    left in the staging area is gone at start, and the drills leave none (each is gone before its drill is logged)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "bad").mkdir()
    torch.save({"step": 20, "trainer": Custom()}, primary / "bad" / "step_20.pt")
    leftover = mirror / ".mirrord-staging" / ".mirrord-drill-killed"
    leftover.mkdir(parents=True)
    (leftover / "step_20.pt").write_bytes(b"a drill killed midway")
    daemon = daemon_factory({"layout": "torch", "drill": {"interval_hours": 24}}).start()
    assert not leftover.exists()
    prometheus = PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{daemon.port}"])
    request.addfinalizer(prometheus.stop)

    def metric(name: str, run: str) -> float | None:
        return daemon.metric(name, f'run="{run}"')

    failed = daemon.wait_event("drill.failed", DRILL_SECONDS)
    assert metric("mirrord_drill_failures_total", "bad") == 1  # (counted before it is logged)
    assert metric("mirrord_drill_last_failure_timestamp_seconds", "bad")
    assert (failed["run"], failed["path"], failed["file"]) == ("bad", "bad/step_20.pt", str(mirror / "bad/step_20.pt"))
    assert failed["error"].startswith("UnpicklingError: Weights only load failed")
    assert "Unsupported global" in failed["error"] and "Custom" in failed["error"]
    assert metric("mirrord_drill_last_success_timestamp_seconds", "bad") is None

    save_checkpoint(primary / "good" / "step_10.pt", 10)
    passed = daemon.wait_event("drill.passed", DRILL_SECONDS)
    assert (passed["run"], passed["path"], passed["step"], passed["loaded"], passed["structure_only"]) == (
        "good",
        "good/step_10.pt",
        10,
        ["good/step_10.pt"],
        False,
    )
    assert metric("mirrord_drill_last_success_timestamp_seconds", "good")
    assert metric("mirrord_drill_failures_total", "good") is None  # (its first failure would make it)
    assert metric("mirrord_drill_last_failure_timestamp_seconds", "good") is None
    assert metric("mirrord_drill_failures_total", "bad") == 1  # its unit not drilled again within 24 h
    assert list((mirror / ".mirrord-staging").iterdir()) == []
    status = run_mirrord("status", "--config", daemon.config_path)
    assert status.returncode == 1, status.stdout  # a failed drill is a problem
    assert "drill good: ok " in status.stdout and " ago" in status.stdout
    assert f"drill bad: FAILED {mirror / 'bad/step_20.pt'}: UnpicklingError" in status.stdout
    [(alert, _)] = prometheus.wait_query('ALERTS{alertname="MirrordDrillFailing", alertstate="firing"}', timeout=60)
    assert alert["run"] == "bad"

    publish_checkpoint(primary / "bad" / "step_30.pt", 30)  # a newer checkpoint of the run, one that loads
    daemon.wait_event("drill.passed", DRILL_SECONDS, run="bad", path="bad/step_30.pt")
    assert metric("mirrord_drill_failures_total", "bad") == 1
    daemon.settings["drill"]["interval_hours"] = 0.0005  # 1.8 s (Prometheus sees the alert resolve meanwhile)
    daemon.write_config()
    daemon.send(signal.SIGHUP)
    wait_for(lambda: not prometheus.query('ALERTS{alertname="MirrordDrillFailing"}'), 60, "the alert resolved")
    wait_for(lambda: len(daemon.events("drill.passed", run="good")) == 2, DRILL_SECONDS, "good drilled again")


def test_a_restarted_daemon_remembers_what_each_runs_drill_found(tmp_path: Path, daemon_factory: Any) -> None:
    """The drills' findings are kept on the mirror (.mirrord-drills.json): a restarted daemon exports each run's
    last success and last failure at once, and drills neither unit again within the interval; a newer unit of
    `good` is drilled (before `bad`, had `bad`'s failure been forgotten: a run never drilled goes first). A state
    the daemon cannot read is said, naming it, and forgotten."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "bad").mkdir()
    torch.save({"step": 20, "trainer": Custom()}, primary / "bad" / "step_20.pt")
    save_checkpoint(primary / "good" / "step_10.pt", 10)
    settings = {"layout": "torch", "drill": {"interval_hours": 24}}
    first = daemon_factory(settings).start()
    first.wait_event("drill.failed", DRILL_SECONDS, run="bad")
    first.wait_event("drill.passed", DRILL_SECONDS, run="good")
    exported = {
        name: first.metric(f"mirrord_drill_last_{name}_timestamp_seconds", f'run="{run}"')
        for name, run in (("success", "good"), ("failure", "bad"))
    }
    assert first.stop() == 0
    assert (mirror / ".mirrord-drills.json").is_file()

    second = daemon_factory(settings).start()
    assert second.metric("mirrord_drill_last_success_timestamp_seconds", 'run="good"') == exported["success"]
    assert second.metric("mirrord_drill_last_failure_timestamp_seconds", 'run="bad"') == exported["failure"]
    assert second.metric("mirrord_drill_last_success_timestamp_seconds", 'run="bad"') is None
    status = run_mirrord("status", "--config", second.config_path)
    assert f"drill bad: FAILED {mirror / 'bad/step_20.pt'}: UnpicklingError" in status.stdout, status.stdout
    publish_checkpoint(primary / "good" / "step_30.pt", 30)
    second.wait_event("drill.passed", DRILL_SECONDS, run="good", path="good/step_30.pt")
    assert [(e["run"], e["path"]) for e in second.events("drill.passed") + second.events("drill.failed")] == [
        ("good", "good/step_30.pt")
    ]

    assert second.stop() == 0
    kept = '{"runs": {"good": {"unit": [], "at": "yesterday", "error": null, "ok_at": null, "failed_at": null}}}'
    (mirror / ".mirrord-drills.json").write_text(kept)
    third = daemon_factory(settings).start()
    said = third.wait_event("drill.state_unreadable")
    assert said["path"] == str(mirror / ".mirrord-drills.json") and "'yesterday'" in said["cause"], said
    third.wait_event("drill.passed", DRILL_SECONDS, run="good", path="good/step_30.pt")  # forgotten: drilled again


def test_the_drill_runs_at_the_copies_priority_and_a_stop_kills_its_loader(tmp_path: Path, daemon_factory: Any) -> None:
    """The drill's loader (held on a FIFO) runs at the copies' [io] priority: nice 10, SCHED_IDLE, I/O class idle
    (what the drill's thread took, and the loader inherits); SIGTERM then stops the daemon at once, with the
    loader gone and no scratch copy left, and no drill recorded (neither failed nor passed)."""
    if platform.machine() not in IOPRIO_GET:
        pytest.skip(f"ioprio_get's syscall number on {platform.machine()} is not known here")
    primary, mirror, shim = tmp_path / "primary", tmp_path / "mirror", tmp_path / "hold"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_LOADER)
    started, gate = tmp_path / "started", tmp_path / "gate"
    os.mkfifo(gate)
    save_checkpoint(primary / "run" / "step_10.pt", 10)
    env = {
        "PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "DRILL_STARTED": str(started),
        "DRILL_GATE": str(gate),
    }
    io = {"ionice": "idle", "cpu_nice": 10, "cpu_policy": "idle"}
    daemon = daemon_factory({"layout": "torch", "drill": {"interval_hours": 24}, "io": io}, env=env).start()
    wait_for(started.exists, DRILL_SECONDS, "the drill's loader started")
    loader = int(started.read_text())
    fields = Path(f"/proc/{loader}/stat").read_text().rsplit(")", 1)[1].split()
    assert (int(fields[16]), int(fields[38])) == (10, os.SCHED_IDLE)  # nice, policy (stat fields 19 and 41)
    ioprio = ctypes.CDLL(None, use_errno=True).syscall(IOPRIO_GET[platform.machine()], 1, loader)
    assert ioprio >> 13 == 3, ioprio  # IOPRIO_CLASS_IDLE
    scratch = mirror / ".mirrord-staging"
    assert [p.name for p in scratch.iterdir() if p.name.startswith(".mirrord-drill-")]

    assert daemon.stop(timeout=60) == 0  # (its shutdown grace is 5 s: the loader's 1800 s bound is not waited for)
    with pytest.raises(ProcessLookupError):
        os.kill(loader, 0)
    assert list(scratch.iterdir()) == []
    assert daemon.events("drill.failed") == daemon.events("drill.passed") == []
    assert not (mirror / ".mirrord-drills.json").exists()


def test_a_drill_that_passed_two_days_ago_fires_mirrord_drill_stale_until_one_passes(
    tmp_path: Path, daemon_factory: Any, request: pytest.FixtureRequest
) -> None:
    """A daemon drills run `exp` and keeps the pass on the mirror, whose time the test then moves 49 h back; a
    daemon restarted with drills off exports that pass at once, and a real Prometheus loading the shipped
    MirrordDrillStale fires it for `exp`; drills turned on by a reload drill `exp` again (its last drill is older
    than the interval), and the alert resolves."""
    save_checkpoint(tmp_path / "primary" / "exp" / "step_10.pt", 10)
    settings = {"layout": "torch", "drill": {"interval_hours": 24}}
    first = daemon_factory(settings).start()
    first.wait_event("drill.passed", DRILL_SECONDS, run="exp")
    assert first.stop() == 0
    state = tmp_path / "mirror" / ".mirrord-drills.json"
    kept = json.loads(state.read_text())
    for name in ("at", "ok_at"):  # as if that drill had passed 49 h ago: its times moved, the rest the daemon's
        kept["runs"]["exp"][name] -= 49 * 3600
    state.write_text(json.dumps(kept))

    settings["drill"]["interval_hours"] = 0
    daemon = daemon_factory(settings).start()
    passed = daemon.metric("mirrord_drill_last_success_timestamp_seconds", 'run="exp"')
    assert passed is not None and 48 * 3600 < time.time() - passed < 50 * 3600, passed
    # The shipped rules with only their `for:` durations set to 0s: the test cannot wait MirrordDrillStale's 10 min
    # (tests/integration/data/alerts_test.yml checks the `for:` with promtool).
    rules = tmp_path / "alerts.yml"
    rules.write_text(re.sub(r"(?m)^(\s+for:) .*$", r"\1 0s", ALERT_RULES.read_text()))
    prometheus = PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{daemon.port}"], rules=rules)
    request.addfinalizer(prometheus.stop)
    [(alert, _)] = prometheus.wait_query('ALERTS{alertname="MirrordDrillStale", alertstate="firing"}', timeout=60)
    assert alert["run"] == "exp"
    assert daemon.events("drill.passed") == daemon.events("drill.failed") == []  # drills off

    daemon.settings["drill"]["interval_hours"] = 24
    daemon.write_config()
    daemon.send(signal.SIGHUP)
    daemon.wait_event("drill.passed", DRILL_SECONDS, run="exp")
    wait_for(lambda: not prometheus.query('ALERTS{alertname="MirrordDrillStale"}'), 60, "MirrordDrillStale resolved")
