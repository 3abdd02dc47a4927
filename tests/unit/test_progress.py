"""ProgressBoard: what readers see of the copies under way, with an injected clock."""

from __future__ import annotations

from mirrord.commands.console import progress_line
from mirrord.core.jobs import CopyJob
from mirrord.service.copier import CopyControl
from mirrord.service.progress import CopyProgress, ProgressBoard

MiB = 2**20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def job(rel: str = "r/step_0007.pt", size: int = 100 * MiB) -> CopyJob:
    return CopyJob(rel, size, 0, 7, "new")


def test_a_tracked_copy_shows_bytes_rate_and_eta_and_leaves_when_done() -> None:
    """Rate is the average since the copy started; ETA is what is left at that rate."""
    clock = Clock()
    board = ProgressBoard(clock)
    control = CopyControl(clock=clock)
    with board.track(job(), control):
        clock.now += 10
        control.advance(25 * MiB)
        [p] = board.snapshot()
        assert (p.path, p.run, p.step, p.size, p.bytes_done) == ("r/step_0007.pt", "r", 7, 100 * MiB, 25 * MiB)
        assert (p.rate, p.eta_seconds, p.fraction) == (2.5 * MiB, 30.0, 0.25)
        assert board.bytes_in_flight() == 25 * MiB
        assert p.to_dict()["eta_seconds"] == 30.0
    assert board.snapshot() == [] and board.bytes_in_flight() == 0


def test_eta_is_unknown_until_the_first_bytes() -> None:
    p = CopyProgress("a.pt", ".", None, 10, 0, 5.0)
    assert (p.rate, p.eta_seconds, p.to_dict()["eta_seconds"]) == (0.0, None, None)
    assert "ETA ?" in progress_line(p)


def test_progress_is_due_for_the_log_every_interval_not_before() -> None:
    clock = Clock()
    board = ProgressBoard(clock)
    control = CopyControl(clock=clock)
    with board.track(job(), control):
        clock.now += 9.9
        assert board.due_for_log(10) == []
        clock.now += 0.1
        assert [p.path for p in board.due_for_log(10)] == ["r/step_0007.pt"]
        assert board.due_for_log(10) == []  # reported: the next one is 10 s later
        clock.now += 10
        assert len(board.due_for_log(10)) == 1


def test_progress_line_for_a_person() -> None:
    line = progress_line(CopyProgress("r/step_9.pt", "r", 9, 4 * 2**30, 2**30, 10.0))
    assert line == ("r/step_9.pt [######..................]  25%  1.0 GiB of 4.0 GiB  102.4 MiB/s  ETA 0:30")
