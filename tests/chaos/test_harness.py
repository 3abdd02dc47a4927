"""The harness itself: a file the filesystem under test will not read is an outcome, never a crash."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from tests.chaos import harness
from tests.chaos.harness import World, converged_violations, crash_violations, split_unreadable


@pytest.fixture
def eio_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    """A world whose mirror holds one good copy and one file that reads as EIO (as after a power cut)."""
    world = World(tmp_path)
    for rel in ("run/step_0001.pt", "run/step_0002.pt"):
        data = rel.encode() * 100
        world.install(rel, data)
        (world.mirror / "run").mkdir(parents=True, exist_ok=True)
        (world.mirror / rel).write_bytes(data)
    real_hash = harness.hash_file

    def hash_file(path: Path, algo: str) -> str:
        if path.name == "step_0002.pt" and world.mirror in path.parents:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_hash(path, algo)

    monkeypatch.setattr(harness, "hash_file", hash_file)
    return world


def test_an_unreadable_mirror_file_is_a_violation_not_a_crash(eio_world: World) -> None:
    found = crash_violations(eio_world)
    io, rest = split_unreadable(found)
    assert io == ["run/step_0002.pt: unreadable on the mirror (Input/output error)"]
    assert rest == []


def test_converged_check_reports_the_unreadable_file_and_still_checks_the_rest(eio_world: World) -> None:
    io, rest = split_unreadable(converged_violations(eio_world, eio_world.primary_files()))
    assert io == ["run/step_0002.pt: unreadable on the mirror (Input/output error)"] * 2
    # The readable copy is checked as usual: it is not recorded in a manifest (there is none).
    assert rest == ["run/step_0001.pt: not recorded in the manifest after a completed restart"]


def _spawn_with_pid(zygote: harness.Zygote, wanted: int, log: Path) -> int | None:
    """Spawn a stopped mirrord child, steering the kernel to give it pid `wanted` (ns_last_pid); the pid
    it got, or None if other processes on the machine kept taking that pid first."""
    for _ in range(200):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(wanted - 1))
        except OSError:
            return None
        pid = zygote.spawn(["--version"], log, stop=True)
        if pid == wanted:
            return pid
        os.kill(pid, signal.SIGKILL)
        zygote.wait(pid, 30)
    return None


def test_zygote_wait_never_answers_with_the_status_of_an_earlier_child_of_the_same_pid(
    zygote: harness.Zygote, tmp_path: Path
) -> None:
    """pids are reused; the status the zygote kept for a reaped child must not answer for a new one."""
    log = tmp_path / "child.log"
    first = zygote.spawn(["--version"], log)
    assert zygote.wait(first, 60) == 0
    second = _spawn_with_pid(zygote, first, log)
    if second is None:
        pytest.skip("could not make the kernel reuse a pid (no writable ns_last_pid, or a busy machine)")
    try:
        status = zygote.wait(second, 0.5)
    finally:
        os.kill(second, signal.SIGKILL)
        final = zygote.wait(second, 30)
    assert status is None, f"a child stopped at start-up was reported as exited with {status} (a stale status)"
    assert final == -signal.SIGKILL
