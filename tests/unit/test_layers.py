"""The layer rules of the package, read from the source with ast (imports at any depth, lazy ones and those
only for type checking included), as strict as the maintainers' ../shared/tools/layers.py: who may import
whom, no two areas importing each other, no import cycle between modules, and durability (rename, fsync,
unlink) in one module."""

from __future__ import annotations

import ast
from pathlib import Path

import mirrord

PACKAGE = Path(mirrord.__file__).parent
# The calls that make a name durable, move it or remove it: only store/atomic.py makes them.
DURABILITY_CALLS = {"replace", "rename", "renames", "unlink", "remove", "fsync", "fdatasync", "rmdir"}
DURABILITY_HOME = {
    "store/atomic.py": "the durability module",
    "paths.py": "the ground floor: a folder it creates beneath a root is made durable where it is made "
    "(its parent fsynced); it publishes no name and may import nothing above it",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str) -> set[str]:
    """Every mirrord module `name` imports, at any depth of its code: lazy imports inside functions and
    imports under `if TYPE_CHECKING:` included (a cycle of types is a cycle of ideas); relative imports
    resolved; `from X import Y` counts as X.Y when X.Y is a module, else as X."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in MODULES else module)
    return {target for target in found if target in MODULES and target != name}


GRAPH = {name: imported(name) for name in MODULES}


def offenders(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    return {
        name: bad
        for name, targets in GRAPH.items()
        if name.startswith(importers) and (bad := {target for target in targets if target.startswith(forbidden)})
    }


def test_the_service_never_imports_a_command() -> None:
    assert offenders(("mirrord.service",), ("mirrord.commands",)) == {}


def test_the_trainer_helper_imports_no_command() -> None:
    assert offenders(("mirrord.torch",), ("mirrord.commands",)) == {}


def test_the_core_is_pure() -> None:
    assert offenders(("mirrord.core",), ("mirrord.store", "mirrord.service", "mirrord.commands")) == {}


def test_formats_read_the_bytes_they_are_given() -> None:
    assert offenders(("mirrord.formats",), ("mirrord.store",)) == {}


def test_the_ground_floor_imports_only_itself() -> None:
    """errors, paths and vocabulary import no other mirrord module than each other."""
    ground = ("mirrord.errors", "mirrord.paths", "mirrord.vocabulary")
    assert {name: GRAPH[name] - set(ground) for name in ground if GRAPH[name] - set(ground)} == {}


def test_the_config_imports_no_planner() -> None:
    assert offenders(("mirrord.config",), ("mirrord.core",)) == {}


def test_storage_knows_no_daemon_and_no_command() -> None:
    assert offenders(("mirrord.store",), ("mirrord.service", "mirrord.commands")) == {}


def area(name: str) -> str:
    """The part of the package a module belongs to: mirrord.<area>[.<module>] ("" for mirrord itself)."""
    return name.split(".")[1] if "." in name else ""


def test_no_two_areas_import_each_other() -> None:
    """The areas form floors: if one imports another, the other imports nothing of it. The entry points
    (cli, __main__) and the package's own __init__ are not floors."""
    edges = {
        (area(name), area(target))
        for name, targets in GRAPH.items()
        for target in targets
        if area(name) not in ("", "cli", "__main__") and area(target) not in ("", "__main__")
    }
    assert sorted((low, high) for low, high in edges if low < high and (high, low) in edges) == []


def cycles() -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    return found


def test_no_import_cycles() -> None:
    assert cycles() == []


def durability_calls(path: Path) -> list[str]:
    return [
        f"os.{node.func.attr}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "os"
        and node.func.attr in DURABILITY_CALLS
    ]


def test_durability_lives_in_atomic() -> None:
    """Every os-level rename, fsync and unlink goes through store/atomic.py (see DURABILITY_HOME)."""
    found = {
        str(path.relative_to(PACKAGE)): calls
        for path in MODULES.values()
        if str(path.relative_to(PACKAGE)) not in DURABILITY_HOME and (calls := durability_calls(path))
    }
    assert found == {}
