"""Helpers shared by the tests: real torch checkpoints, mirror invariants, the CLI, dropped privileges."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mirrord.atomic import TEMP_SUFFIX
from mirrord.hashing import hash_file
from mirrord.manifest import MANIFEST_NAME, Manifest

# Checkpoints look as if the trainer wrote them an hour ago, so they are settled and their mtimes
# (which the mirror must preserve) are known. Each step gets its own second.
BASE_MTIME_NS = 1_700_000_000 * 10**9
NOBODY = 65534


_CHECKPOINT_CACHE: dict[tuple[int, int, int], bytes] = {}
_CACHE_LIMIT_BYTES = 32 * 2**20


def save_checkpoint(
    path: Path, step: int, width: int = 64, depth: int = 2, mtime_ns: int | None = None
) -> Path:
    """torch.save a small MLP with Adam state (one optimizer step taken) and the step counter.

    The file size grows with width**2 * depth * 3 (weights, exp_avg, exp_avg_sq, float32). The same
    (step, width, depth) always gives the same bytes; small ones are kept in memory after the first
    torch.save, so tests pay for torch once.
    """
    key = (step, width, depth)
    path.parent.mkdir(parents=True, exist_ok=True)
    if key in _CHECKPOINT_CACHE:
        path.write_bytes(_CHECKPOINT_CACHE[key])
    else:
        _torch_save(path, step, width, depth)
        if path.stat().st_size <= _CACHE_LIMIT_BYTES:
            _CHECKPOINT_CACHE[key] = path.read_bytes()
    mtime_ns = BASE_MTIME_NS + step * 10**9 if mtime_ns is None else mtime_ns
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def _torch_save(path: Path, step: int, width: int, depth: int) -> None:
    import torch  # only the tests that make checkpoints pay for importing torch

    torch.manual_seed(step)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for param in model.parameters():  # a real step without autograd: gives Adam its state
        param.grad = torch.randn_like(param)
    optimizer.step()
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def train_state(seed: int = 0) -> dict[str, object]:
    """A small model with its Adam state after one step: what a trainer checkpoints."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).square().mean().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": seed}


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def names(directory: Path) -> list[str]:
    """The entries of one directory, sorted."""
    return sorted(p.name for p in directory.iterdir())


def mirror_files(mirror: Path) -> dict[str, Path]:
    """Every non-hidden regular file below mirror, by POSIX relative path (symlinks are not followed)."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(mirror):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath) / name
                found[path.relative_to(mirror).as_posix()] = path
    return found


def temp_files(mirror: Path) -> list[str]:
    """Every NAME.part anywhere below mirror, hidden directories included."""
    return sorted(
        (Path(d) / n).relative_to(mirror).as_posix()
        for d, _dirs, names in os.walk(mirror)
        for n in names
        if n.endswith(TEMP_SUFFIX)
    )


def assert_mirror_consistent(primary: Path, mirror: Path, ignore: frozenset[str] = frozenset()) -> None:
    """The invariants that must hold after any fault.

    No NAME.part is left; every final-named file (except those in `ignore`, planted by the test) is
    byte-identical to its source; every manifest entry names a file whose size and digest it records.
    """
    assert temp_files(mirror) == [], f"temp files left on the mirror: {temp_files(mirror)}"
    for rel, path in mirror_files(mirror).items():
        if rel in ignore:
            continue
        source = primary / rel
        assert source.is_file(), f"{rel} is on the mirror but has no source"
        assert path.stat().st_size == source.stat().st_size, f"{rel}: size differs from its source"
        assert sha256(path) == sha256(source), f"{rel}: content differs from its source"
    if (mirror / MANIFEST_NAME).exists():
        for entry in Manifest.load(mirror).entries.values():
            path = mirror / entry.path
            assert path.is_file(), f"manifest records {entry.path} but it is not on the mirror"
            assert path.stat().st_size == entry.size, f"{entry.path}: size differs from the manifest"
            assert hash_file(path, entry.algo) == entry.digest, f"{entry.path}: digest differs"


def mirrord_argv() -> list[str]:
    """The installed console script next to this interpreter, else `python -m mirrord.cli`."""
    script = Path(sys.executable).parent / "mirrord"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mirrord.cli"]


def run_mirrord(
    *args: str | Path, env: Mapping[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `mirrord ARGS` in a child process with no MIRRORD_* variables except those in env."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    child_env.update(env or {})
    return subprocess.run(
        [*mirrord_argv(), *map(str, args)],
        capture_output=True, text=True, env=child_env, timeout=timeout, check=False, cwd=cwd,
    )


def log_events(stderr: str) -> list[dict[str, Any]]:
    """The JSON log events in a child's stderr (other lines are ignored)."""
    events = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def run_as_nobody(func: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Run func(*args) in a forked child that dropped root for uid/gid 65534, and return its outcome.

    Root bypasses permission bits, so a permission-denied fault can only be real in a process that
    is not root. The child is forked (not exec'd) because the interpreter itself lives where nobody
    cannot read it. Returns {"value": ...} or {"error": type name, "path", "cause", "transient", "text"}.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                outcome: dict[str, Any] = {"value": func(*args)}
            except Exception as exc:
                outcome = {
                    "error": type(exc).__name__,
                    "path": getattr(exc, "path", None),
                    "cause": getattr(exc, "cause", None),
                    "transient": getattr(exc, "transient", None),
                    "text": str(exc),
                }
            data = json.dumps(outcome, default=str).encode()
            while data:
                data = data[os.write(write_fd, data):]
        except BaseException:
            code = 1
            with open(2, "w", closefd=False) as err:
                err.write(traceback.format_exc())
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged child crashed"
    result: dict[str, Any] = json.loads(b"".join(chunks))
    return result
