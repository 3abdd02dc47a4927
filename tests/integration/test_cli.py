"""The command line itself: the command list, -V, start-up logging, the daemon's registry as scraped."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from mirrord import __version__
from mirrord.cli import SUMMARIES
from mirrord.obs.metrics import PRUNE_REFUSED_REASONS
from tests.support.cli import mirrord_argv, run_mirrord
from tests.support.daemon import DaemonProcess


def test_no_arguments_prints_every_command_with_a_summary() -> None:
    """`mirrord` alone lists the commands (not just a usage line) and exits 2: a command is needed."""
    result = run_mirrord()
    assert (result.returncode, result.stdout) == (2, "")
    flat = " ".join(result.stderr.split())  # argparse wraps long lines
    for name, summary in SUMMARIES.items():
        assert f"{name} {' '.join(summary.split())}" in flat, name
    assert "Exit codes" in flat


def test_version_short_and_long() -> None:
    for flag in ("-V", "--version"):
        result = run_mirrord(flag)
        assert (result.returncode, result.stdout.strip()) == (0, f"mirrord {__version__}")


def test_daemon_logs_absolute_paths_and_exports_runtime_metrics(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """A config with relative roots, read from another working directory: the daemon mirrors the folders
    next to the file and logs them as absolute paths. Its /metrics has process_* and python_* series,
    every prune refusal reason at 0 before any refusal, and no *_created series. Kubernetes service
    variables in its environment are logged once."""
    kubernetes = {"MIRRORD_SERVICE_HOST": "10.96.0.12", "MIRRORD_PORT": "tcp://10.96.0.12:9108"}
    daemon = daemon_factory({"primary": "primary", "mirror": "mirror"}, env=kubernetes).start()
    loaded = daemon.wait_event("config.loaded")
    assert loaded["file"] == str(tmp_path / "mirrord.toml")
    assert (loaded["primary"], loaded["mirror"]) == (str(tmp_path / "primary"), str(tmp_path / "mirror"))
    starting = daemon.wait_event("daemon.starting")
    assert (starting["primary"], starting["mirror"]) == (str(tmp_path / "primary"), str(tmp_path / "mirror"))
    assert (tmp_path / "mirror").is_dir()

    code, body = daemon.http("/metrics")
    assert code == 200
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")}
    assert {
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "python_info",
        "python_gc_collections_total",
    } <= names
    assert not [n for n in names if n.endswith("_created")]
    for reason in PRUNE_REFUSED_REASONS:
        assert daemon.metric("mirrord_prune_refused_total", f'reason="{reason}"') == 0.0, reason

    # Kubernetes' service variables: ignored, and said so once, not again on every SIGHUP reload.
    daemon.send(signal.SIGHUP)
    daemon.wait_event("config.reloaded")
    [ignored] = daemon.events("config.environment_ignored")
    assert sorted(ignored["variables"]) == sorted(kubernetes)
    assert daemon.stop() == 0


# --- shell completion and the man page -----------------------------------------------------------------

BASH_DRIVER = r"""
source <("$@" completion bash)
while IFS= read -r line; do
    read -ra COMP_WORDS <<< "$line"
    [[ "$line" == *" " ]] && COMP_WORDS+=("")
    COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
    COMPREPLY=()
    _mirrord
    echo "${COMPREPLY[*]}"
done
"""


def _complete_in_bash(lines: list[str], cwd: Path) -> list[str]:
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_DRIVER, "bash", *mirrord_argv()],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_bash_completes_commands_options_and_values(tmp_path: Path) -> None:
    """bash sources `mirrord completion bash` and its function completes what the parser accepts."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt.toml").write_text("")
    got = _complete_in_bash(
        [
            "mirrord sy",
            "mirrord ch",
            "mirrord check-config --format ",
            "mirrord sync --log-level w",
            "mirrord completion ",
            "mirrord init --sys",
            "mirrord run --primary ck",
            "mirrord run --config ck",
        ],
        tmp_path,
    )
    assert got == [
        "sync",
        "check-config",
        "toml json",
        "warning",
        "-h --help bash zsh fish",
        "--systemd",
        "ckpt",
        "ckpt ckpt.toml",
    ]


def test_fish_completes_commands_and_values(tmp_path: Path) -> None:
    """fish loads the script and its own completion engine answers from it."""
    assert shutil.which("fish"), "fish not installed (Debian package fish; .ci/run installs it)"
    script = tmp_path / "mirrord.fish"
    script.write_text(run_mirrord("completion", "fish").stdout)
    probe = (
        f"source {script}; complete --do-complete 'mirrord sy'; echo ---; "
        "complete --do-complete 'mirrord check-config --format '; echo ---; "
        "complete --do-complete 'mirrord verify --d'"
    )
    result = subprocess.run(
        ["fish", "--no-config", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    first, second, third = (block.strip().splitlines() for block in result.stdout.split("---"))
    assert [ln.split("\t")[0] for ln in first] == ["sync"] and "copy every committed" in first[0]
    assert sorted(ln.split("\t")[0] for ln in second) == ["json", "toml"]
    assert [ln.split("\t")[0] for ln in third] == ["--deep"]


# zsh completes only inside its line editor: a zpty drives an interactive `zsh -f -i` as a terminal would.
# Each `zpty -r` waits for its pattern (the Python-side timeout is the deadline); \t is the Tab key.
ZSH_DRIVER = r"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "PS1='> '; fpath=($PWD/functions \$fpath); autoload -U compinit; compinit -u -d $PWD/dump; \
path=($MIRRORD_BIN \$path); echo READY"
zpty -r z out '*READY*'
zpty -w -n z $'mirrord sy\t'
zpty -r z out '*mirrord sync*'
print -r -- COMPLETED-COMMAND
zpty -w -n z $'\C-u'
zpty -w -n z $'mirrord check-config --format \t'
zpty -r z out '*json*toml*'
print -r -- LISTED-VALUES
zpty -d z
"""


def test_zsh_completes_a_command_and_lists_values(tmp_path: Path) -> None:
    """zsh parses the script; from $fpath, compinit loads it and Tab completes `sy` to `sync` and lists
    the values of --format."""
    assert shutil.which("zsh"), "zsh not installed (Debian package zsh; .ci/run installs it)"
    functions = tmp_path / "functions"
    functions.mkdir()
    (functions / "_mirrord").write_text(run_mirrord("completion", "zsh").stdout)
    syntax = subprocess.run(
        ["zsh", "-n", str(functions / "_mirrord")], capture_output=True, text=True, timeout=60, check=False
    )
    assert syntax.returncode == 0, syntax.stderr
    env = {
        "HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
        "TERM": "xterm",
        "MIRRORD_BIN": str(Path(mirrord_argv()[0]).parent),
    }
    result = subprocess.run(
        ["zsh", "-f", "-c", ZSH_DRIVER], capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["COMPLETED-COMMAND", "LISTED-VALUES"]


def test_man_page_renders_without_warnings_and_documents_every_command(tmp_path: Path) -> None:
    """`mirrord man` is valid roff (groff -ww reports nothing) and names every command and option."""
    page = tmp_path / "mirrord.1"
    page.write_text(run_mirrord("man").stdout)
    groff = shutil.which("groff")
    assert groff, "groff not installed (Debian package groff-base; .ci/run installs it)"
    lint = subprocess.run(
        [groff, "-man", "-ww", "-z", str(page)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (lint.returncode, lint.stderr) == (0, "")
    text = subprocess.run(
        [groff, "-man", "-Tutf8", "-P", "-cbou", str(page)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    ).stdout
    flat = " ".join(text.replace("\u2010", "-").replace("\u2212", "-").split())
    for name in SUMMARIES:
        assert f"mirrord {name} [-h]" in flat, name
    for words in ("--keep-last N", "--format {toml,json}", "MIRRORD_CONFIG", "EXIT STATUS", f"mirrord {__version__}"):
        assert words in flat, words
