"""Logs: JSON lines off a TTY, console rendering on one, level filtering, and events that name their checkpoint."""

from __future__ import annotations

import io
import json
import os
import pty
import select
from pathlib import Path
from typing import Any

import pytest

from mirrord.core.jobs import CopyJob
from mirrord.core.model import step_of
from mirrord.errors import NoSpaceError
from mirrord.obs import log
from mirrord.obs.metrics import Metrics
from mirrord.service.engine import Engine
from mirrord.service.pruner import Pruner
from mirrord.service.workers import copy_all
from mirrord.store.volume import LocalMirror, LocalVolume
from tests.support.engine import copy_once


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    """Every line must be one JSON object: a collector (journald, Docker) reads them one by one."""
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def read_pty(master: int) -> str:
    """Everything written to the terminal so far (the writer has flushed and returned)."""
    chunks = []
    timeout = 5.0  # a deadline for the first byte only; then drain what is there
    while select.select([master], [], [], timeout)[0]:
        timeout = 0
        data = os.read(master, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode()


def copy(primary: Path, mirror: Path, make_config: Any, rel: str, **config: Any) -> None:
    cfg = make_config(**config)
    volume = LocalMirror(mirror)
    st = (primary / rel).stat()
    job = CopyJob(rel, st.st_size, st.st_mtime_ns, step_of(rel, cfg.step_regex), "new")
    copy_once(Engine(cfg, volume, volume.read_manifest(), Metrics()), job)


def test_json_lines_when_the_stream_is_not_a_tty() -> None:
    """auto picks JSON off a TTY; each line carries event, level, an ISO UTC timestamp and the fields."""
    out = io.StringIO()
    log.configure("auto", "info", out)
    log.get_logger().info("copy.committed", path="run/step_0001.pt", size=12)
    log.get_logger().warning("copy.failed", path="run/step_0002.pt", reason="no_space")
    first, second = json_lines(out)
    assert first["event"] == "copy.committed" and first["level"] == "info"
    assert first["path"] == "run/step_0001.pt" and first["size"] == 12
    assert first["timestamp"].endswith("Z")
    assert second["level"] == "warning" and second["reason"] == "no_space"


def test_console_rendering_on_a_tty() -> None:
    """On a terminal (a real pty) auto renders for a person: not JSON, event and key=value visible."""
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=True) as tty:
            assert tty.isatty()
            log.configure("auto", "info", tty)
            log.get_logger().info("copy.committed", path="run/step_0001.pt", step=1)
            tty.flush()
            text = read_pty(master)
    finally:
        os.close(master)
    line = text.strip()
    assert "copy.committed" in line
    assert "step_0001.pt" in line
    assert not line.startswith("{")


def test_console_format_can_be_forced_off_a_tty_without_colour_codes() -> None:
    """log.format = console on a pipe: readable text, and no escape sequences in a file."""
    out = io.StringIO()
    log.configure("console", "info", out)
    log.get_logger().info("daemon.ready", status="0 copied")
    text = out.getvalue()
    assert "daemon.ready" in text and "status" in text
    assert "\x1b[" not in text
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_can_be_forced_on_a_tty() -> None:
    """log.format = json on a terminal still writes JSON lines (for people piping through jq)."""
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=True) as tty:
            log.configure("json", "info", tty)
            log.get_logger().info("daemon.ready")
            tty.flush()
            text = read_pty(master)
    finally:
        os.close(master)
    assert json.loads(text.strip())["event"] == "daemon.ready"


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("debug", ["d", "i", "w", "e"]),
        ("info", ["i", "w", "e"]),
        ("warning", ["w", "e"]),
        ("error", ["e"]),
    ],
)
def test_level_filtering(level: str, expected: list[str]) -> None:
    """Events below the configured level are dropped."""
    out = io.StringIO()
    log.configure("json", level, out)
    logger = log.get_logger()
    logger.debug("d")
    logger.info("i")
    logger.warning("w")
    logger.error("e")
    assert [e["event"] for e in json_lines(out)] == expected


def test_reconfigure_applies_to_loggers_made_earlier() -> None:
    """A SIGHUP changes the level at run time: loggers obtained before must follow it."""
    out = io.StringIO()
    log.configure("json", "info", out)
    logger = log.get_logger()
    log.configure("json", "error", out)
    logger.info("dropped")
    logger.error("kept")
    assert [e["event"] for e in json_lines(out)] == ["kept"]


def test_copy_events_name_the_checkpoint_with_relative_path_run_step_size(
    make_config, primary, mirror, checkpoint
) -> None:
    """copy.started / copy.committed carry event, relative path, run, step, size and a duration."""
    src = checkpoint(primary / "runA" / "step_0042.pt", 42)
    out = io.StringIO()
    log.configure("json", "info", out)
    copy(primary, mirror, make_config, "runA/step_0042.pt")
    events = {e["event"]: e for e in json_lines(out)}
    assert {"copy.started", "copy.committed"} <= events.keys()
    for name in ("copy.started", "copy.committed"):
        e = events[name]
        assert (e["path"], e["run"], e["step"], e["size"]) == ("runA/step_0042.pt", "runA", 42, src.stat().st_size), (
            name
        )
    assert events["copy.committed"]["seconds"] >= 0
    assert events["copy.committed"]["digest"]


def test_one_line_per_state_change_not_per_chunk(make_config, primary, mirror, checkpoint) -> None:
    """A copy of many buffers logs started and committed once each: no per-chunk spam."""
    src = checkpoint(primary / "step_0001.pt", 1, width=512)
    out = io.StringIO()
    log.configure("json", "debug", out)
    copy(primary, mirror, make_config, "step_0001.pt", io={"buffer_bytes": 64 * 1024})
    assert src.stat().st_size > 20 * 64 * 1024
    assert [e["event"] for e in json_lines(out)] == ["copy.started", "copy.committed"]


def test_a_root_level_checkpoint_has_run_dot(make_config, primary, mirror, checkpoint) -> None:
    """A file directly under the root belongs to run "." (never an empty or absent field)."""
    checkpoint(primary / "step_0003.pt", 3)
    out = io.StringIO()
    log.configure("json", "info", out)
    copy(primary, mirror, make_config, "step_0003.pt")
    assert {e["run"] for e in json_lines(out)} == {"."}


def test_failure_events_carry_reason_and_checkpoint(make_config, primary, mirror, checkpoint) -> None:
    """copy.failed says what failed (path, run, step), why (reason, cause) and whether it will retry."""
    checkpoint(primary / "r" / "step_0005.pt", 5)
    cfg = make_config(copy={"free_space_reserve_bytes": 2**62, "max_attempts": 1})
    volume = LocalMirror(mirror)
    st = (primary / "r" / "step_0005.pt").stat()
    job = CopyJob("r/step_0005.pt", st.st_size, st.st_mtime_ns, 5, "new")
    out = io.StringIO()
    log.configure("json", "info", out)
    outcome = copy_all(Engine(cfg, volume, volume.read_manifest(), Metrics()), [job], 1)[job.rel]
    assert isinstance(outcome, NoSpaceError)
    failed = [e for e in json_lines(out) if e["event"] == "copy.failed"]
    assert len(failed) == 1
    e = failed[0]
    assert (e["level"], e["path"], e["run"], e["step"], e["reason"], e["will_retry"]) == (
        "warning",
        "r/step_0005.pt",
        "r",
        5,
        "no_space",
        False,
    )
    assert "bytes) free" in e["cause"]


def test_prune_events_carry_volume_path_run_step_size(make_config, primary, mirror, checkpoint) -> None:
    """prune.deleted and prune.skipped name the checkpoint and (for skips) the guard's reason."""
    for step in (1, 2, 3):
        checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
        copy(primary, mirror, make_config, f"r/step_{step:04d}.pt")
    cfg = make_config(prune={"keep_last": 1, "min_age_seconds": 0})
    volume = LocalMirror(mirror)
    out = io.StringIO()
    log.configure("json", "info", out)
    Pruner(
        cfg,
        LocalVolume(primary),
        volume,
        volume.read_manifest(),
        Metrics(),
        in_flight=lambda: frozenset({"r/step_0001.pt"}),
    ).run_cycle()
    events = json_lines(out)
    deleted = [e for e in events if e["event"] == "prune.deleted"]
    skipped = [e for e in events if e["event"] == "prune.skipped"]
    assert [(e["volume"], e["path"], e["run"], e["step"]) for e in deleted] == [("mirror", "r/step_0002.pt", "r", 2)]
    assert deleted[0]["size"] == (primary / "r" / "step_0002.pt").stat().st_size
    assert [(e["path"], e["reason"]) for e in skipped] == [("r/step_0001.pt", "in_flight")]
    assert any(e["event"] == "prune.finished" for e in events)


@pytest.mark.parametrize("level", ["debug", "info"])
def test_each_file_retention_keeps_is_logged_at_debug_level_only(
    make_config, primary, mirror, checkpoint, level
) -> None:
    """prune.kept names every kept file with the policy that keeps it, at debug level; at info the pass does not
    even build those events (a daemon keeps every file of both sides at each rescan)."""
    for step in (1, 2):
        checkpoint(primary / "r" / f"step_{step:04d}.pt", step)
        copy(primary, mirror, make_config, f"r/step_{step:04d}.pt")
    cfg = make_config(prune={"keep_last": 5, "min_age_seconds": 0})
    volume = LocalMirror(mirror)
    out = io.StringIO()
    log.configure("json", level, out)
    Pruner(cfg, LocalVolume(primary), volume, volume.read_manifest(), Metrics()).run_cycle()
    kept = sorted((e["volume"], e["path"], e["why"]) for e in json_lines(out) if e["event"] == "prune.kept")
    assert kept == (
        [(side, f"r/step_{step:04d}.pt", "keep_last") for side in ("mirror", "primary") for step in (1, 2)]
        if level == "debug"
        else []
    )


def test_a_failing_log_stream_never_reaches_the_caller() -> None:
    """A full disk or a closed pipe under the log must not stop a copy or kill a worker thread."""

    class Full(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(28, "No space left on device")

    log.configure("json", "info", Full())
    log.get_logger().info("copy.committed", path="r/step_0001.pt")  # must not raise
    log.get_logger().error("copy.failed", path="r/step_0001.pt")
