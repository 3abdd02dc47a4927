"""SIGHUP reloads: a file being written is not read as whole; risky changes are named."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from mirrord.config import Config, read_stable, risky_changes


def test_a_file_written_while_read_is_read_to_the_end(tmp_path: Path) -> None:
    """A writer pausing mid-file: read_stable waits until the file stopped changing for `quiet`."""
    path = tmp_path / "c.toml"
    path.write_text("[prune]\nkeep_last = 2")

    def finish() -> None:
        time.sleep(0.3)  # the writer's pause: the situation under test
        with path.open("a") as f:
            f.write("0\n")

    writer = threading.Thread(target=finish)
    writer.start()
    data, stable = read_stable(path, quiet=0.6, timeout=5)
    writer.join()
    assert stable and data == b"[prune]\nkeep_last = 20\n"


def test_a_file_that_never_settles_is_unstable(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("x")
    stop = threading.Event()

    def keep_writing() -> None:
        n = 0
        while not stop.wait(0.05):
            n += 1
            path.write_text("x" * n)

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        _, stable = read_stable(path, quiet=0.5, timeout=1.0)
    finally:
        stop.set()
        writer.join()
    assert not stable


def test_risky_changes_are_those_that_delete_more_or_sooner() -> None:
    base = Config.model_validate({"mirror": "/m", "prune": {"enabled": False, "keep_last": 20, "min_age_seconds": 600}})
    assert risky_changes(base, base) == []
    worse = Config.model_validate({"mirror": "/m", "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 60}})
    found = " ".join(risky_changes(base, worse))
    assert "prune.enabled" in found and "keep_last lowered from 20 to 2" in found and "min_age" in found
    safer = Config.model_validate({"mirror": "/m",
                                   "prune": {"enabled": False, "keep_last": 30, "min_age_seconds": 900}})
    assert risky_changes(base, safer) == []
