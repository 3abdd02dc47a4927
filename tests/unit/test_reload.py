"""SIGHUP reloads: a file being written is not read as whole; risky changes are named."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mirrord.config import Config, read_stable, risky_changes


@dataclass
class ReadersClock:
    """read_stable's clock, moved only by its own pauses; `writer` runs during each pause with the time it
    ends. What a writer does between two reads is then exactly what the test says, however loaded the
    machine (a writer thread on a real clock can be held off the CPU or the disk for longer than `quiet`,
    and a file it meant to keep changing looks settled)."""

    writer: Callable[[float], None]
    now: float = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.writer(self.now)


def test_a_file_written_while_read_is_read_to_the_end(tmp_path: Path) -> None:
    """A writer pausing mid-file: read_stable waits until the file stopped changing for `quiet` after the
    last change (not since it started reading), and returns the whole file."""
    path = tmp_path / "c.toml"
    path.write_text("[prune]\nkeep_last = 2")
    changed_at: list[float] = []

    def finish(now: float) -> None:
        if now >= 0.5 and not changed_at:  # the writer's pause: the situation under test
            with path.open("a") as f:
                f.write("0\n")
            changed_at.append(now)

    clock = ReadersClock(finish)
    data, stable = read_stable(path, quiet=1.0, timeout=5, pause=0.25, sleep=clock.sleep, monotonic=clock.monotonic)
    assert stable and data == b"[prune]\nkeep_last = 20\n"
    assert changed_at == [0.5] and clock.now >= 0.5 + 1.0


def test_a_file_that_never_settles_is_unstable(tmp_path: Path) -> None:
    """A file that changes between every two reads is never stable: read_stable gives up at its timeout,
    says so, and returns the file as it last read it."""
    path = tmp_path / "c.toml"
    path.write_text("x")
    writes: list[float] = []

    def keep_writing(now: float) -> None:
        writes.append(now)
        path.write_text("x" * (len(writes) + 1))

    clock = ReadersClock(keep_writing)
    data, stable = read_stable(path, quiet=0.5, timeout=2.0, pause=0.25, sleep=clock.sleep, monotonic=clock.monotonic)
    assert not stable and data == b"x" * (len(writes) + 1)
    assert clock.now == 2.0 and len(writes) == 8  # read until the timeout, not a read fewer


def test_risky_changes_are_those_that_delete_more_or_sooner() -> None:
    base = Config.model_validate({"mirror": "/m", "prune": {"enabled": False, "keep_last": 20, "min_age_seconds": 600}})
    assert risky_changes(base, base) == []
    worse = Config.model_validate({"mirror": "/m", "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 60}})
    found = " ".join(risky_changes(base, worse))
    assert "prune.enabled" in found and "keep_last lowered from 20 to 2" in found and "min_age" in found
    safer = Config.model_validate(
        {"mirror": "/m", "prune": {"enabled": False, "keep_last": 30, "min_age_seconds": 900}}
    )
    assert risky_changes(base, safer) == []
