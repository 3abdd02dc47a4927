"""A training script saves with atomic_save and resumes with latest_checkpoint: no partial file is ever
published, and a damaged checkpoint is never chosen for a resume."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mirrord.formats.zipcheck import check_torch_zip
from mirrord.store.atomic import temp_path
from mirrord.torch import SaveResult, atomic_save, latest_checkpoint
from tests.support.checkpoints import checkpoint_state
from tests.support.mirror import hash_file


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


@pytest.mark.parametrize("algo", ["blake3", "sha256", "xxh3_128"])
def test_atomic_save_publishes_a_whole_checkpoint_with_its_digest(tmp_path: Path, algo: str) -> None:
    """The returned size and digest are those of the file on disk, in the manifest's algorithms."""
    path = tmp_path / "step_00000001.pt"
    state = checkpoint_state()
    result = atomic_save(state, path, algo=algo)
    assert result == SaveResult(path, path.stat().st_size, algo, hash_file(path, algo))
    assert not temp_path(path).exists()
    assert check_torch_zip(path).ok
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    for key, tensor in state["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(loaded["model"][key], tensor)
    assert loaded["optimizer"]["state"][0]["step"] == 1


def test_atomic_save_accepts_str_paths_and_torch_save_options(tmp_path: Path) -> None:
    """A str path works, and keyword arguments reach torch.save (here: the legacy format)."""
    path = tmp_path / "legacy.pt"
    result = atomic_save({"w": torch.ones(4)}, str(path), _use_new_zipfile_serialization=False)
    assert result.path == path
    assert check_torch_zip(path).status == "legacy_pickle"


def test_atomic_save_replaces_an_existing_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "latest.pt"
    atomic_save({"w": torch.zeros(3)}, path)
    atomic_save({"w": torch.ones(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))


class _Unpicklable:
    """Fails in the middle of torch.save's pickling, as a stray lock or file handle in a state dict would."""

    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("cannot pickle this")


def test_exception_during_save_removes_the_part_and_reraises(tmp_path: Path) -> None:
    """A failed save leaves neither a .part nor a new final name, and the error reaches the caller."""
    path = tmp_path / "step_00000002.pt"
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        atomic_save({"w": torch.ones(1000), "bad": _Unpicklable()}, path)
    assert sorted(tmp_path.iterdir()) == []


def test_unpicklable_builtin_object_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A failed overwrite leaves the previous checkpoint in place, byte for byte."""
    path = tmp_path / "latest.pt"
    first = atomic_save(checkpoint_state(1), path)
    with pytest.raises(TypeError):
        atomic_save({"lock": threading.Lock()}, path)
    assert sorted(tmp_path.iterdir()) == [path]
    assert hash_file(path, "blake3") == first.digest


def test_unknown_algorithm_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        atomic_save({"w": torch.ones(1)}, tmp_path / "x.pt", algo="md5")
    assert sorted(tmp_path.iterdir()) == []


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from mirrord.torch import atomic_save
    # Several large storages: the file grows through many writes that a SIGKILL can interrupt.
    big = {f"layer{i}": torch.full((16 * 1024 * 1024,), float(i)) for i in range(8)}  # 8 x 64 MiB
    atomic_save(big, sys.argv[1])
    """
)


def test_kill_9_during_atomic_save_publishes_nothing(tmp_path: Path) -> None:
    """SIGKILL in the middle of writing a 512 MiB checkpoint: no final name; resume picks the previous one."""
    previous = tmp_path / "step_00000001.pt"
    atomic_save(checkpoint_state(1), previous)
    final = tmp_path / "step_00000002.pt"
    part = temp_path(final)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(final)])
    try:
        _wait_for(lambda: part.exists() and part.stat().st_size > 1 << 20, 120, f"{part.name} to pass 1 MiB")
        first = part.stat().st_size
        _wait_for(lambda: part.stat().st_size > first, 60, f"{part.name} to keep growing")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
    assert not final.exists()
    assert part.stat().st_size < 8 * 64 * 1024 * 1024
    assert check_torch_zip(part).status == "truncated"
    assert latest_checkpoint(tmp_path, require_manifest=False) == previous


def _truncate(path: Path, percent: int) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) * percent // 100])


def _flip_middle_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: _truncate(p, 25), id="truncated-25"),
        pytest.param(lambda p: _truncate(p, 50), id="truncated-50"),
        pytest.param(lambda p: _truncate(p, 73), id="truncated-73"),
        pytest.param(lambda p: _truncate(p, 99), id="truncated-99"),
        pytest.param(_flip_middle_byte, id="flipped-byte"),
    ],
)
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    """On a primary without a manifest, latest_checkpoint passes over a damaged newer step."""
    run = tmp_path / "run"
    run.mkdir()
    good = run / "step_00000010.pt"
    atomic_save(checkpoint_state(10), good)
    newest = run / "step_00000020.pt"
    atomic_save(checkpoint_state(20), newest)
    assert latest_checkpoint(tmp_path, require_manifest=False) == newest
    damage(newest)
    assert not check_torch_zip(newest).ok
    assert latest_checkpoint(tmp_path, require_manifest=False) == good
    assert latest_checkpoint(tmp_path, run="run", require_manifest=False) == good
