"""The worker pool with real threads and real files: stalls, retries, dedup and shutdown."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from mirrord.config import load_config
from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.errors import MirrordError
from mirrord.obs.metrics import Metrics
from mirrord.service.engine import Engine
from mirrord.service.jobqueue import JobQueue
from mirrord.service.retry import RetryPolicy
from mirrord.service.workers import WorkerPool
from mirrord.store.volume import LocalMirror
from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for


def _setup(tmp_path: Path, **copy: object) -> tuple[Engine, JobQueue, Path, Path]:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    config = load_config(environ={}, overrides={
        "primary": str(primary), "mirror": str(mirror),
        "copy": {"free_space_reserve_bytes": 0, "retry_backoff_seconds": 0.01, **copy},
        "io": {"buffer_bytes": 1024 * 1024},
    })
    lm = LocalMirror(mirror)
    lm.root.mkdir()
    return Engine(config, lm, lm.read_manifest(), Metrics()), JobQueue(), primary, mirror


def _pool(engine: Engine, queue: JobQueue, size: int, outcomes: list[CopyResult | MirrordError],
          **options: Any) -> WorkerPool:
    """A pool copying with `engine` as the daemon's does: its retry policy, stalls counted in its metrics."""
    return WorkerPool(engine.copy_once, queue, size, retry=RetryPolicy.from_config(engine.config),
                      on_done=lambda job, outcome: outcomes.append(outcome),
                      on_stalled=lambda job: engine.metrics.copy_result("stalled"), **options)


def _job(primary: Path, rel: str, step: int) -> CopyJob:
    st = (primary / rel).stat()
    return CopyJob(rel, st.st_size, st.st_mtime_ns, step, "new")


def test_transient_errors_are_retried_then_given_up(tmp_path, monkeypatch):
    engine, queue, primary, mirror = _setup(tmp_path, max_attempts=3)
    publish_checkpoint(primary / "step_0001.pt", 1)
    attempts = {"n": 0}

    def eio(self: object, data: memoryview) -> None:
        attempts["n"] += 1
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("mirrord.store.volume.LocalUpload.write", eio)
    outcomes: list[CopyResult | MirrordError] = []
    pool = _pool(engine, queue, 2, outcomes)
    queue.put(_job(primary, "step_0001.pt", 1))
    wait_for(lambda: outcomes, 60, "the job to give up")
    assert attempts["n"] == 3
    assert isinstance(outcomes[0], MirrordError) and "step_0001.pt" in outcomes[0].path
    assert "Input/output error" in outcomes[0].cause
    assert not (mirror / "step_0001.pt").exists() and not list(mirror.rglob("*.part"))
    assert queue.paths() == frozenset()
    assert pool.stop(grace=5)


def test_queue_holds_a_path_once_and_serves_newest_step_first(tmp_path):
    queue = JobQueue()
    jobs = [CopyJob(f"r/step_{s}.pt", 1, 1, s, "new") for s in (1, 5, 3)]
    assert all(queue.put(j) for j in jobs)
    assert not queue.put(jobs[0])
    got = [queue.get(timeout=1) for _ in range(3)]
    assert [e.job.step for e in got if e] == [5, 3, 1]
    assert not queue.put(jobs[1])  # still reserved while being copied
    queue.done(jobs[1].rel)
    assert queue.put(jobs[1])


def test_copy_threads_run_at_io_cpu_nice(tmp_path, monkeypatch):
    """io.cpu_nice is the nice value of the threads that copy and hash (so they yield the CPU to a
    trainer), read back from the kernel while the copy runs; the calling thread is left as it was."""
    engine, queue, primary, mirror = _setup(tmp_path)
    publish_checkpoint(primary / "step_0001.pt", 1)
    seen: list[int] = []
    real_readv = os.readv

    def readv(fd: int, buffers: list[bytearray]) -> int:
        # /proc/thread-self/stat field 19 is the nice value the scheduler uses for this thread.
        seen.append(int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[16]))
        return real_readv(fd, buffers)

    monkeypatch.setattr("mirrord.service.copier.os.readv", readv)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    outcomes: list[CopyResult | MirrordError] = []
    pool = _pool(engine, queue, 1, outcomes, cpu_nice=max(mine, 7))
    queue.put(_job(primary, "step_0001.pt", 1))
    wait_for(lambda: outcomes, 60, "the copy")
    assert isinstance(outcomes[0], CopyResult)
    assert (mirror / "step_0001.pt").exists()
    assert seen and set(seen) == {max(mine, 7)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert pool.stop(grace=5)


def test_copy_threads_run_at_io_cpu_policy_idle(tmp_path, monkeypatch):
    """io.cpu_policy = "idle" puts the threads that read, hash and write under SCHED_IDLE, read back
    from the kernel by each of them while the copy runs (the write helper inherits it); the calling
    thread keeps its own policy."""
    engine, queue, primary, mirror = _setup(tmp_path)
    publish_checkpoint(primary / "step_0001.pt", 1)
    readers: set[int] = set()
    writers: set[int] = set()
    real_readv, real_write = os.readv, os.write

    def policy() -> int:  # /proc/thread-self/stat field 41: the scheduling policy
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[38])

    def readv(fd: int, buffers: list[bytearray]) -> int:
        readers.add(policy())
        return real_readv(fd, buffers)

    def write(fd: int, data: bytes) -> int:
        if threading.current_thread().name.startswith("mirrord-write"):
            writers.add(policy())
        return real_write(fd, data)

    monkeypatch.setattr("mirrord.service.copier.os.readv", readv)
    monkeypatch.setattr("mirrord.store.volume.os.write", write)
    mine = os.sched_getscheduler(0)
    outcomes: list[CopyResult | MirrordError] = []
    pool = _pool(engine, queue, 1, outcomes, cpu_policy="idle")
    queue.put(_job(primary, "step_0001.pt", 1))
    wait_for(lambda: outcomes, 60, "the copy")
    assert isinstance(outcomes[0], CopyResult)
    assert (mirror / "step_0001.pt").exists()
    assert readers == {os.SCHED_IDLE} and writers == {os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == mine != os.SCHED_IDLE
    assert pool.stop(grace=5)
