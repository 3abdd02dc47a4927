"""Build step: the man page and the shell completions, generated from mirrord's own argument parser.

Everything else about the package is declared in pyproject.toml. `build_py` writes into the wheel's
mirrord/data/: man/mirrord.1, completion/mirrord.bash, completion/_mirrord (zsh), completion/mirrord.fish.
mirrord.cli imports only the standard library at load time, so this runs in an isolated build
environment that has none of mirrord's dependencies.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithGeneratedDocs(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install runs from the source; `mirrord man` / `completion` generate on demand
        sys.path.insert(0, str(HERE))
        from mirrord import __version__
        from mirrord.cli import build_parser
        from mirrord.commands.completion import script
        from mirrord.commands.manpage import render

        parser = build_parser()
        generated = {
            "man/mirrord.1": render(parser, __version__),
            "completion/mirrord.bash": script("bash", parser),
            "completion/_mirrord": script("zsh", parser),
            "completion/mirrord.fish": script("fish", parser),
        }
        for rel, text in generated.items():
            target = Path(self.build_lib) / "mirrord" / "data" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")


setup(cmdclass={"build_py": BuildPyWithGeneratedDocs})
