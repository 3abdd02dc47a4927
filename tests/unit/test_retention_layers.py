"""The floors retention spans: the pure core imports no store, service or command; the service (the daemon and
its retention executor) imports no command. Read from the source with ast, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import mirrord

PACKAGE = Path(mirrord.__file__).parent


def imported(module: Path) -> set[str]:
    """Every mirrord module `module` imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {name for name in names if name.startswith("mirrord.")}


def offenders(floor: str, forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    found = {}
    for module in sorted((PACKAGE / floor).rglob("*.py")):
        bad = {name for name in imported(module) if name.startswith(forbidden)}
        if bad:
            found[str(module.relative_to(PACKAGE))] = bad
    return found


def test_the_core_is_pure() -> None:
    """core/ (planners, guards, retention) imports neither the store nor the service nor a command."""
    assert offenders("core", ("mirrord.store", "mirrord.service", "mirrord.commands")) == {}


def test_the_service_never_imports_a_command() -> None:
    """The retention executor lives below the CLI: service/ imports nothing from commands/."""
    assert offenders("service", ("mirrord.commands",)) == {}
