"""RetryPolicy: how often and when a failed copy is tried again; the queue's public QueuedJob."""

from __future__ import annotations

import pytest

from mirrord.config import Config
from mirrord.core.jobs import CopyJob
from mirrord.service.jobqueue import JobQueue, QueuedJob
from mirrord.service.retry import RetryPolicy


def test_delay_doubles_per_attempt_within_its_jitter_and_stops_at_the_cap() -> None:
    """Attempt n waits between d/2 and d, d = base * 2^(n-1), never more than the cap."""
    policy = RetryPolicy(max_attempts=10, backoff_seconds=1.0, backoff_max_seconds=6.0)
    assert [policy.delay(n, rand=lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 6.0, 6.0]
    assert [policy.delay(n, rand=lambda: 0.0) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert all(0.5 <= policy.delay(1) <= 1.0 for _ in range(200))


@pytest.mark.parametrize(("attempt", "again"), [(1, True), (2, True), (3, False), (4, False)])
def test_retries_until_max_attempts(attempt: int, again: bool) -> None:
    """max_attempts counts the first attempt: 3 means two retries."""
    assert RetryPolicy(max_attempts=3).retries(attempt) is again


def test_from_config_takes_copy_settings_and_the_rescan_only_for_a_daemon(make_config) -> None:
    """A one-shot command has no next rescan to promise; the daemon does."""
    config: Config = make_config(
        copy={"max_attempts": 4, "retry_backoff_seconds": 0.5, "retry_backoff_max_seconds": 9.0},
        watch={"rescan_interval_seconds": 42},
    )
    assert RetryPolicy.from_config(config) == RetryPolicy(4, 0.5, 9.0, None)
    assert RetryPolicy.from_config(config, rescans=True).rescan_seconds == 42


def test_the_queue_hands_out_a_public_queued_job_with_its_attempt_and_first_seen() -> None:
    """A retry keeps the time the job was first queued (the lag) and counts its attempt."""
    now = [100.0]
    queue = JobQueue(clock=lambda: now[0])
    job = CopyJob("r/step_1.pt", 1, 1, 1, "new")
    assert queue.put(job)
    got = queue.get(timeout=0)
    assert isinstance(got, QueuedJob) and (got.job, got.attempt, got.first_seen) == (job, 1, 100.0)
    now[0] = 105.0
    queue.release_for_retry(got, delay=2.0)
    assert queue.get(timeout=0) is None  # not due yet
    assert [(q.attempt, q.first_seen) for q in queue.pending()] == [(2, 100.0)]
    now[0] = 107.5
    again = queue.get(timeout=0)
    assert again is not None and (again.attempt, again.first_seen) == (2, 100.0)
