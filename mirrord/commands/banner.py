"""What a person starting mirrord by hand is told: what is in force, and the exact command to type next.

`make run` and `make demo` install mirrord into ./.venv without putting it on PATH, so "type `mirrord
status`" would fail; the hints name the command that works from here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from mirrord import __version__
from mirrord.config import Config
from mirrord.core.retention import describe_policy


def mirrord_command() -> str:
    """How to run this installation of mirrord from the current directory.

    `mirrord` when that name on PATH is this installation; else its script (`.venv/bin/mirrord`,
    relative when below the current directory); else `python -m mirrord` with this interpreter.
    """
    script = Path(sys.executable).parent / "mirrord"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m mirrord"
    on_path = shutil.which("mirrord")
    if on_path is not None and Path(on_path).resolve() == script.resolve():
        return "mirrord"
    absolute, cwd = script.absolute(), Path.cwd()
    return shlex.quote(str(absolute.relative_to(cwd) if absolute.is_relative_to(cwd) else absolute))


def run_banner(config: Config, config_file: Path | None) -> str:
    """Printed by `mirrord run` on a terminal, before the log starts."""
    command, q = mirrord_command(), shlex.quote
    # The arguments that point another command at the same primary and mirror.
    where = (
        f"--config {q(str(config_file))}"
        if config_file is not None
        else f"--primary {q(str(config.primary))} --mirror {q(str(config.mirror_target))}"
    )
    lines = [
        f"mirrord {__version__}: mirroring {config.primary} -> {config.mirror_target} ({', '.join(config.patterns)})",
        f"  retention  {describe_policy(config.prune, config.retention_mode[0] == 'follow')}",
    ]
    if config.metrics.enabled:
        lines.append(f"  endpoints  http://{config.metrics.address}/metrics  /healthz  /readyz  /status")
    lines += [
        f"  status     {command} status {where}   (from another terminal)",
        "  stop       Ctrl-C (copies under way get daemon.shutdown_grace_seconds; a second Ctrl-C aborts them)",
    ]
    if command != "mirrord" and os.sep in command:
        lines.append(f"  note       `mirrord` is not on PATH here: use {command}, or activate its venv")
    return "\n".join(lines)
