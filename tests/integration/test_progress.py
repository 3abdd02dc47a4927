"""A long copy is visible while it runs (log, metric, /status, `mirrord status`, `sync` on a terminal),
and one cut short by a second Ctrl-C says which file it was. Real daemons, real terminals (a pty)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.terminal import Terminal
from tests.support.checkpoints import publish_checkpoint
from tests.support.cli import mirrord_argv, run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.logs import parse_events
from tests.support.mirror import assert_mirror_consistent, temp_files
from tests.support.wait import wait_for

MiB = 2**20


def test_a_long_copy_shows_its_progress_and_a_second_sigint_logs_the_aborted_file(
    tmp_path, gated_primary, daemon_factory
) -> None:
    """A copy held at a gate, moved on once (so its bytes are seen growing) and held again: it is seen
    everywhere while it waits, then a second SIGINT aborts it."""
    mirror = tmp_path / "mirror"
    publish_checkpoint(gated_primary.backing / "r" / "step_0042.pt", 42, megabytes=64)
    gated_primary.stall("step_0042.pt", after=16 * MiB)
    d: DaemonProcess = daemon_factory({"io": {"drop_cache": False}, "daemon": {"shutdown_grace_seconds": 60}}).start()
    d.wait_event("copy.started", path="r/step_0042.pt")

    first = wait_for(lambda: d.metric("mirrord_copy_bytes_in_flight"), 90, "bytes in flight")
    gated_primary.stall("step_0042.pt", after=40 * MiB)  # the gate moves on, and holds again
    wait_for(lambda: (d.metric("mirrord_copy_bytes_in_flight") or 0) > first, 90, "bytes in flight growing")

    code, body = d.http("/status")
    [copy] = json.loads(body)["copies"]
    assert code == 200 and copy["path"] == "r/step_0042.pt" and copy["step"] == 42
    assert 0 < copy["bytes_done"] < copy["size"] and copy["rate_bytes_per_second"] > 0
    assert copy["eta_seconds"] is not None and copy["eta_seconds"] > 0

    shown = run_mirrord("status", "--config", d.config_path)
    line = next(x for x in shown.stdout.splitlines() if "copying r/" in x)
    assert re.search(r"r/step_0042\.pt  [\d.]+ MiB of [\d.]+ MiB \(\d+%\), [\d.]+ (MiB|KiB)/s, ETA \d", line), line
    doc = json.loads(run_mirrord("status", "--json", "--config", d.config_path).stdout)
    assert [c["path"] for c in doc["daemon"]["copying"]] == ["r/step_0042.pt"]

    progress = d.wait_event("copy.progress", timeout=90, path="r/step_0042.pt")
    assert progress["seconds"] >= 10 and 0 < progress["bytes_done"] < progress["size"]
    assert progress["rate_mib_s"] > 0 and progress["eta_seconds"] > 0 and 0 < progress["percent"] < 100

    d.send(signal.SIGINT)
    d.wait_event("daemon.stopping")
    d.send(signal.SIGINT)  # the second one: abort the copy now
    d.wait_event("stop.cancelling_copies", why="second stop signal")
    gated_primary.unstall()  # the held read returns, and the copy sees it is cancelled
    assert d.proc is not None and d.proc.wait(timeout=90) == 0
    [aborted] = d.events("copy.aborted")
    assert (aborted["path"], aborted["step"], aborted["why"]) == ("r/step_0042.pt", 42, "second stop signal")
    assert 0 < aborted["bytes_done"] < aborted["size"]
    assert temp_files(mirror) == [] and not (mirror / "r" / "step_0042.pt").exists()


def test_ctrl_c_during_sync_logs_the_aborted_copy_and_leaves_no_part(tmp_path: Path, gated_primary) -> None:
    primary, mirror = gated_primary.mount_point, tmp_path / "mirror"
    publish_checkpoint(gated_primary.backing / "step_0009.pt", 9, megabytes=24)
    gated_primary.stall("step_0009.pt", after=16 * MiB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    env.update(MIRRORD_COPY__SETTLE_SECONDS="0", MIRRORD_LOG__FORMAT="json")
    log = tmp_path / "sync.log"
    with log.open("wb") as err:
        # SIGINT as at a terminal, even if pytest itself runs with SIGINT ignored (a background job).
        proc = subprocess.Popen(
            [*mirrord_argv(), "sync", "--primary", str(primary), "--mirror", str(mirror)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        part = mirror / "step_0009.pt.part"
        wait_for(lambda: part.exists() and part.stat().st_size > 0, 90, "copy under way")
        proc.send_signal(signal.SIGINT)
        gated_primary.unstall_once_cancelling(log, ended=lambda: proc.poll() is not None)
        assert proc.wait(timeout=90) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    [aborted] = [e for e in parse_events(log.read_text()) if e["event"] == "copy.aborted"]
    assert (aborted["path"], aborted["step"], aborted["why"]) == ("step_0009.pt", 9, "interrupted")
    assert 0 < aborted["bytes_done"] < aborted["size"]
    assert temp_files(mirror) == [] and not (mirror / "step_0009.pt").exists()


def test_sync_on_a_terminal_shows_each_copy_with_bytes_rate_and_eta(tmp_path: Path, gated_primary) -> None:
    """Both copies held at a gate until the terminal shows each one's live line; then the same sync with
    stderr piped, held until its periodic copy.progress: log lines only, no live view."""
    primary, mirror = gated_primary.mount_point, tmp_path / "mirror"
    names = ("step_0001.pt", "step_0002.pt")
    for step, name in enumerate(names, 1):
        publish_checkpoint(gated_primary.backing / name, step, megabytes=24)
    gated_primary.stall(*names, after=8 * MiB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    env.update(TERM="xterm", MIRRORD_COPY__SETTLE_SECONDS="0", MIRRORD_COPY__WORKERS="2")
    terminal = Terminal([*mirrord_argv(), "sync", "--primary", str(primary), "--mirror", str(mirror)], env)
    try:
        for name in names:
            # e.g. "step_0001.pt [########................]  33%  8.0 MiB of 24.0 MiB  8.0 MiB/s  ETA 0:02"
            pattern = re.compile(rf"{name} \[[#.]+\] +\d+%  [\d.]+ [KM]iB of 24\.0 MiB  [\d.]+ [KM]iB/s  ETA \d+:\d\d")

            def shown(pattern: re.Pattern[str] = pattern) -> bool:
                terminal.read(0.2)
                return any(pattern.search(x) and "ETA ?" not in x for x in terminal.text.splitlines())

            wait_for(shown, 90, f"a progress line for {name}", interval=0)
        gated_primary.unstall()
        code = terminal.finish(timeout=120)
    finally:
        gated_primary.unstall()
        terminal.close()
    screen = terminal.text
    assert code == 0, screen
    assert_mirror_consistent(gated_primary.backing, mirror)
    assert "copy.committed" in screen  # the log lines still reach the terminal, above the live lines

    gated_primary.stall(names[0], after=8 * MiB)
    log = tmp_path / "piped.log"
    with log.open("wb") as err:
        piped = subprocess.Popen(
            [*mirrord_argv(), "sync", "--primary", str(primary), "--mirror", str(tmp_path / "piped")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**env, "TERM": "dumb"},
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: b"copy.progress" in log.read_bytes() or piped.poll() is not None, 90, "a periodic progress report"
        )
        gated_primary.unstall()
        assert piped.wait(timeout=90) == 0, log.read_text()
    finally:
        if piped.poll() is None:
            os.killpg(piped.pid, signal.SIGKILL)
            piped.wait()
    assert "copy.progress" in log.read_text() and "ETA" not in log.read_text()  # not a terminal: log lines only


def test_the_terminal_view_is_imported_only_for_a_terminal() -> None:
    """The live view is for a person's terminal: the daemon and every command's module load without it.
    (structlog itself imports rich whenever it is installed, as it is beside transformers: only what
    mirrord adds counts.)"""
    code = (
        "import sys, structlog; before = set(sys.modules); "
        "import mirrord.cli, mirrord.service.daemon, mirrord.commands.sync, mirrord.commands.status, "
        "mirrord.commands.report, mirrord.service.progress, mirrord.commands.banner; "
        "print(sorted(m for m in set(sys.modules) - before if m in "
        "('mirrord.commands.console', 'rich')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
