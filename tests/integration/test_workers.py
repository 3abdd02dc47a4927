"""The worker pool with real threads and real files: stalls, retries, dedup and shutdown."""

from __future__ import annotations

import functools
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
from tests.support.engine import copy_once
from tests.support.wait import wait_for


def _setup(tmp_path: Path, **copy: object) -> tuple[Engine, JobQueue, Path, Path]:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": str(mirror),
            "copy": {"free_space_reserve_bytes": 0, "retry_backoff_seconds": 0.01, **copy},
            "io": {"buffer_bytes": 1024 * 1024},
        },
    )
    lm = LocalMirror(mirror)
    lm.root.mkdir()
    return Engine(config, lm, lm.read_manifest(), Metrics()), JobQueue(), primary, mirror


def _pool(
    engine: Engine, queue: JobQueue, size: int, outcomes: list[CopyResult | MirrordError], **options: Any
) -> WorkerPool:
    """A pool copying with `engine` as the daemon's does: its retry policy, stalls counted in its metrics."""
    return WorkerPool(
        functools.partial(copy_once, engine),
        queue,
        size,
        retry=RetryPolicy.from_config(engine.config),
        on_done=lambda job, outcome: outcomes.append(outcome),
        on_stalled=lambda job: engine.metrics.copy_result("stalled"),
        **options,
    )


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


def test_a_failure_after_a_copy_is_logged_and_the_worker_goes_on(tmp_path, logs):
    """Finishing a copy fails (here its outcome's receiver raises once): the error is logged with the path,
    the outcome still reaches its receiver, and the only worker copies the next file."""
    engine, queue, primary, mirror = _setup(tmp_path)
    for step in (1, 2):
        publish_checkpoint(primary / f"step_000{step}.pt", step)
    outcomes: list[CopyResult | MirrordError] = []

    def on_done(job: CopyJob, outcome: CopyResult | MirrordError) -> None:
        outcomes.append(outcome)
        if len(outcomes) == 1:
            raise RuntimeError("receiver broke")

    pool = WorkerPool(functools.partial(copy_once, engine), queue, 1, on_done=on_done)
    try:
        queue.put(_job(primary, "step_0002.pt", 2))
        wait_for(lambda: len(outcomes) == 2, 60, "the failed finish to be handled")
        [failed] = [e for e in logs if e["event"] == "worker.finish_failed"]
        assert failed["path"] == "step_0002.pt" and "receiver broke" in failed["error"]
        queue.put(_job(primary, "step_0001.pt", 1))
        wait_for(lambda: len(outcomes) == 3, 60, "the next copy")
        assert (mirror / "step_0001.pt").exists() and (mirror / "step_0002.pt").exists()
    finally:
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


def test_one_worker_is_kept_for_small_files_while_big_copies_are_held(tmp_path):
    """Two workers, two big checkpoints held in flight by a gate: only one of them takes a worker, and a
    small step queued behind them is copied at once by the other; the second big one waits its turn."""
    gate, started, copied = threading.Event(), [], []
    queue = JobQueue()
    queue.keep_lane_for_small(small_bytes=1024, workers=2)

    def copy(job: CopyJob, control: object) -> CopyResult:
        started.append(job.rel)
        if job.size >= 1024:
            assert gate.wait(60), "the test never opened the gate"
        copied.append(job.rel)
        return CopyResult(job.rel, job.size, "blake3", "00", job.mtime_ns, 0.0)

    outcomes: list[CopyResult | MirrordError] = []
    pool = WorkerPool(copy, queue, 2, on_done=lambda job, outcome: outcomes.append(outcome))
    try:
        for step in (10, 11):
            queue.put(CopyJob(f"r/step_{step}.pt", 2 << 30, 1, step, "new"))
        wait_for(lambda: len(started) == 1, 30, "a big copy to start")
        queue.put(CopyJob("r/step_9.pt", 100, 1, 9, "new"))  # older and small: still not starved
        wait_for(lambda: "r/step_9.pt" in copied, 30, "the small file to be copied beside the big one")
        assert started == ["r/step_11.pt", "r/step_9.pt"]  # newest big first; the second big waits
        gate.set()
        wait_for(lambda: len(outcomes) == 3, 30, "every copy to finish")
        assert sorted(copied) == ["r/step_10.pt", "r/step_11.pt", "r/step_9.pt"]
    finally:
        gate.set()
        assert pool.stop(grace=5)


def test_a_single_worker_takes_big_files_and_the_lane_can_be_turned_off():
    queue = JobQueue()
    queue.keep_lane_for_small(small_bytes=1024, workers=1)
    for step in (1, 2):
        queue.put(CopyJob(f"r/step_{step}.pt", 4096, 1, step, "new"))
    first = queue.get(timeout=1)
    assert first is not None and first.job.step == 2
    assert queue.get(timeout=0.05) is None  # the one big slot is taken
    queue.done(first.job.rel)
    second = queue.get(timeout=1)
    assert second is not None and second.job.step == 1
    queue.keep_lane_for_small(small_bytes=0, workers=1)
    queue.put(CopyJob("r/step_3.pt", 4096, 1, 3, "new"))
    assert queue.get(timeout=1) is not None  # no lane: any job takes any worker
