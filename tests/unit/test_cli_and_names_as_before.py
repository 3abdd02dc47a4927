"""What the command line and the config accepted and showed before they were made smaller, and must still:
the order of --json in help, man page and completions; help width for a COLUMNS that is not positive;
file names such as ".\n" for unit.complete_marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from mirrord import cli
from mirrord.commands.completion import describe
from mirrord.config import load_config
from mirrord.errors import ConfigError


@pytest.mark.parametrize("marker", ["done", ".\n", "..\n", "...", ".done"])
def test_a_complete_marker_that_is_a_plain_file_name_is_accepted(tmp_path: Path, marker: str) -> None:
    """Only '.', '..', a '/' or a NUL are refused (724bb50's check_file_name): '.\\n' is a file name,
    as '$' in a regular expression also matches before a final newline."""
    env = {
        "MIRRORD_PRIMARY": str(tmp_path),
        "MIRRORD_MIRROR": str(tmp_path / "m"),
        "MIRRORD_LAYOUT": "custom",
        "MIRRORD_UNIT__KIND": "folder",
        "MIRRORD_UNIT__COMPLETE_MARKER": marker,
    }
    assert load_config(None, environ=env, check_roots=False).unit.complete_marker == marker


@pytest.mark.parametrize("marker", [".", "..", "a/b", "x\0"])
def test_a_complete_marker_that_is_not_a_file_name_is_refused(tmp_path: Path, marker: str) -> None:
    env = {
        "MIRRORD_PRIMARY": str(tmp_path),
        "MIRRORD_MIRROR": str(tmp_path / "m"),
        "MIRRORD_LAYOUT": "custom",
        "MIRRORD_UNIT__KIND": "folder",
        "MIRRORD_UNIT__COMPLETE_MARKER": marker,
    }
    with pytest.raises(ConfigError, match="is not a file name"):
        load_config(None, environ=env, check_roots=False)


@pytest.mark.parametrize("columns", ["-5", "0"])
def test_help_is_never_narrower_than_a_terminal_for_a_columns_that_is_not_positive(
    monkeypatch: pytest.MonkeyPatch, columns: str
) -> None:
    """COLUMNS that is not a positive number is ignored (as shutil.get_terminal_size does), not taken as a
    width: help of a negative width is one word per line."""
    monkeypatch.setenv("COLUMNS", columns)
    assert cli._help_formatter("mirrord")._width >= 78  # (80 without a terminal, else the terminal's)


def test_json_comes_after_the_configuration_options_in_help_man_and_completions() -> None:
    """--json was added after the configuration flags (sync, verify, latest) or last (restore, prune): the
    order --help, the man page and the completion scripts print."""
    _, commands = describe(cli.build_parser())
    flags = {c.name: [o.flags[-1] for o in c.options] for c in commands}
    for name in ("sync", "verify", "latest"):
        assert flags[name].index("--json") == flags[name].index("--log-format") + 1, flags[name]
    for name in ("restore", "prune"):
        assert flags[name][-1] == "--json", flags[name]
