"""The installed `mirrord` command, run as a child process the way a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def mirrord_argv() -> list[str]:
    """The installed console script next to this interpreter, else `python -m mirrord.cli`."""
    script = Path(sys.executable).parent / "mirrord"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mirrord.cli"]


def child_env(extra: Mapping[str, str] | None = None, drop: tuple[str, ...] = ("MIRRORD_",)) -> dict[str, str]:
    """This process's environment without variables starting with `drop`, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra or {})
    return env


def run_mirrord(
    *args: str | Path, env: Mapping[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `mirrord ARGS` in a child process with no MIRRORD_* variables except those in env."""
    return subprocess.run(
        [*mirrord_argv(), *map(str, args)],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=timeout,
        check=False,
        cwd=cwd,
    )
