"""The wheel carries what an installed mirrord needs without a checkout: example config, unit, alert rules,
and the man page and shell completions that setup.py generates from the parser at build time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from mirrord import __version__
from mirrord.cli import build_parser
from mirrord.commands.completion import script
from mirrord.commands.manpage import render

REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_config_unit_rules_man_page_and_completions(tmp_path: Path) -> None:
    """`pip wheel` on a copy of the source (so the checkout gets no build/ folder), then the listing."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, source)
    for folder in ("mirrord", "config", "systemd"):
        shutil.copytree(REPO / folder, source / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    [wheel] = (tmp_path / "dist").glob(f"mirrord-{__version__}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {name: zf.read(name).decode() for name in zf.namelist() if name.startswith("mirrord/data/")}
    parser = build_parser()
    expected = {
        "mirrord/data/mirrord.toml": (REPO / "config" / "mirrord.toml").read_text(),
        "mirrord/data/mirrord.service": (REPO / "systemd" / "mirrord.service").read_text(),
        "mirrord/data/alerts.yml": (REPO / "config" / "prometheus" / "alerts.yml").read_text(),
        "mirrord/data/grafana/mirrord.json": (REPO / "mirrord" / "data" / "grafana" / "mirrord.json").read_text(),
        "mirrord/data/man/mirrord.1": render(parser, __version__),
        "mirrord/data/completion/mirrord.bash": script("bash", parser),
        "mirrord/data/completion/_mirrord": script("zsh", parser),
        "mirrord/data/completion/mirrord.fish": script("fish", parser),
    }
    assert sorted(shipped) == sorted(expected)
    for name, text in expected.items():
        assert shipped[name] == text, name
