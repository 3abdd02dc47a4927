"""Messages name the real cause, and say nothing internal: each case as a user meets it (issue 35)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.checkpoints import save_checkpoint
from tests.support.cli import child_env, mirrord_argv, run_mirrord


def _roots(tmp_path: Path) -> tuple[Path, Path]:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "run_a").mkdir(parents=True)
    mirror.mkdir()
    return primary, mirror


@pytest.mark.parametrize("command", [["check-config"], ["prune", "--dry-run"], ["latest"]])
def test_a_reader_that_left_ends_the_command_quietly(tmp_path: Path, command: list[str]) -> None:
    """`mirrord ... | head`: the pipe's reader is gone before the first write; no traceback, exit 141."""
    primary, mirror = _roots(tmp_path)
    save_checkpoint(primary / "run_a" / "step_1.pt", step=1)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([*mirrord_argv(), *command, "--primary", str(primary), "--mirror", str(mirror)],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, env=child_env(), timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode in (141, 1), result.stderr  # latest on an empty mirror has nothing to print: 1
