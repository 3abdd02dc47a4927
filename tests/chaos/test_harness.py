"""The harness itself: a file the filesystem under test will not read is an outcome, never a crash."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos import harness
from tests.chaos.harness import World, converged_violations, crash_violations, split_unreadable
from tests.support.wait import wait_for


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


@pytest.mark.host  # steers the kernel's next pid (ns_last_pid)
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


CHURN = """
import os, sys, threading
root = sys.argv[1]
def churn(k):
    n = 0
    while True:  # like retention next to the copier: files appear and are deleted all the time
        path = os.path.join(root, f"{k}-{n}")
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        if n:
            os.unlink(os.path.join(root, f"{k}-{n - 1}"))
        n += 1
for k in range(3):
    threading.Thread(target=churn, args=(k,), daemon=True).start()
threading.Event().wait()
"""


def _churned(root: Path) -> int:
    """How many files the churn process has written in `root` so far (its threads' newest numbers)."""
    newest: dict[str, int] = {}
    for path in root.iterdir():
        thread, n = path.name.split("-")
        newest[thread] = max(int(n), newest.get(thread, 0))
    return sum(newest.values())


def test_a_frozen_process_changes_nothing_between_a_listing_and_the_reads(tmp_path: Path) -> None:
    """The kill -9 trainer rounds check a mirror a running daemon works on. Unfrozen, a file deleted
    after the check listed it read as lost (ENOENT); frozen(), every thread of the process is stopped:
    while a twin process (the clock, never frozen) writes and deletes 300 files, the frozen one changes
    nothing; after the freeze it goes on."""
    procs = {}
    for name in ("frozen", "twin"):
        (tmp_path / name).mkdir()
        procs[name] = subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path / name)], start_new_session=True)
    root, twin = tmp_path / "frozen", tmp_path / "twin"
    try:
        wait_for(
            lambda: _churned(root) >= 3 and _churned(twin) >= 3, 60, "the churning threads to start", interval=0.02
        )
        with harness.frozen(procs["frozen"].pid):
            names = {p.name for p in root.iterdir()}
            goal = _churned(twin) + 300
            while _churned(twin) < goal:
                for name in names:
                    (root / name).read_bytes()  # FileNotFoundError if the frozen process still ran
                assert {p.name for p in root.iterdir()} == names, "the files changed while the process was frozen"
        wait_for(
            lambda: {p.name for p in root.iterdir()} != names,
            60,
            "the process to go on after the freeze",
            interval=0.02,
        )
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
