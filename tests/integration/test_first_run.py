"""The first minutes of a new user: `make run`/`make demo` put mirrord in ./.venv, not on PATH, so every
command we tell them to type must work as printed; and `mirrord run` on a terminal says what retention
is in force before it deletes anything."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.terminal import Terminal
from tests.support.cli import mirrord_argv
from tests.support.config import settings, write_config
from tests.support.ports import free_port

VENV_BIN = str(Path(sys.executable).parent)


def _env(on_path: bool) -> dict[str, str]:
    """The caller's environment without MIRRORD_*; this venv's bin on PATH or not (as after `make run`)."""
    dirs = [d for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if d and d != VENV_BIN]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    env["PATH"] = os.pathsep.join([VENV_BIN, *dirs] if on_path else dirs)
    return env


def _typed(command: str, cwd: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """Run a line as a person would paste it into a shell in `cwd` (plus `extra` arguments)."""
    return subprocess.run(
        [*shlex.split(command), *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_demos_try_next_commands_work_as_printed_without_mirrord_on_path(tmp_path: Path) -> None:
    env = _env(on_path=False)
    directory = tmp_path / "demo"
    result = subprocess.run(
        [*mirrord_argv(), "demo", "--dir", str(directory), "--steps", "2", "--interval", "0.2", "--no-torch"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tail = result.stdout[result.stdout.index("Try next:") :]
    tried = [line.split("#")[0].strip() for line in tail.splitlines()[1:] if line.startswith("  ")]
    assert len(tried) == 4 and all(not t.startswith("mirrord ") for t in tried), tail
    assert "`mirrord` is not on PATH here" in tail
    for command in tried[:3]:  # status, verify --deep, latest (the fourth runs a daemon: below)
        done = _typed(command, tmp_path, env)
        if " status" in command:  # the demo's daemon is gone: status says so, as its only problem (exit 1)
            problems = done.stdout[done.stdout.index("problems:") :].splitlines()[1:]
            assert done.returncode == 1 and [p.split(":")[0].strip() for p in problems if "!" in p] == ["! daemon"], (
                command,
                done.stdout,
            )
            continue
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert _typed(tried[2], tmp_path, env).stdout.strip().endswith("demo-run/step_0002.pt")


def test_run_on_a_terminal_shows_retention_endpoints_and_a_status_command_that_works(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    port = free_port()
    config = tmp_path / "mirrord.toml"
    write_config(
        config,
        settings(
            primary,
            mirror,
            {
                "prune": {"keep_last": 4, "primary": True, "min_age_seconds": 30},
                "metrics": {"address": f"127.0.0.1:{port}"},
            },
        ),
    )
    for on_path in (False, True):
        env = _env(on_path)
        terminal = Terminal([*mirrord_argv(), "run", "--config", str(config)], env, cwd=tmp_path)
        try:
            shown = terminal.wait_for_text("daemon.ready", timeout=90)
            assert (
                "retention  keep_last=4 verified steps per run; older steps are deleted on the mirror and "
                "the primary, except a checkpoint the trainer's newest bookkeeping still keeps (Lightning's "
                "best_k_models and best_model_path, HF's best_model_checkpoint) or a pointer names; nothing "
                "younger than min_age_seconds=30 is deleted"
            ) in shown
            assert f"endpoints  http://127.0.0.1:{port}/metrics  /healthz  /readyz  /status" in shown
            status_line = next(line for line in shown.splitlines() if line.strip().startswith("status "))
            command = status_line.strip()[len("status") :].split("(")[0].strip()
            assert command.startswith("mirrord status") == on_path, command
            checked = _typed(command, tmp_path, env, "--timeout", "30")  # a loaded box may answer slowly
            assert checked.returncode == 0, (command, checked.stdout, checked.stderr)
            assert "healthy, ready" in checked.stdout
            terminal.proc.send_signal(signal.SIGINT)
            assert terminal.finish(timeout=90) == 0
        finally:
            terminal.close()
