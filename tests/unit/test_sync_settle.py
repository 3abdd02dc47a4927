"""`mirrord sync` waits for what is still settling after its copies, however long the copies took."""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mirrord.commands.sync as sync
from mirrord.config import Config
from tests.support.checkpoints import save_checkpoint


def test_a_tag_file_that_waits_for_its_folders_is_copied_after_copies_longer_than_the_settle_wait(
    primary: Path, mirror: Path, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's `latest` is copied only once the folders it names are verified, and it is first looked at
    then. Copies that outlast three settle periods (a big checkpoint, a busy machine: the CI run that found this)
    must not use up that wait: the tag file is still copied, not left as unsettled. The copies take an hour here
    on sync's clock, which the test moves on after each round of copies."""
    old = time.time() - 3600
    for step in (2, 4):
        path = save_checkpoint(primary / "run" / f"global_step{step}" / "mp_rank_00_model_states.pt", step)
        os.utime(path, (old, old))
        os.utime(path.parent, (old, old))
    (primary / "run" / "latest").write_text("global_step4")
    os.utime(primary / "run" / "latest", (old, old))
    config = make_config(layout="deepspeed", copy={"settle_seconds": 0.2}, unit={"settle_seconds": 0.2})

    hour = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + hour[0], time=time.time, sleep=time.sleep)
    monkeypatch.setattr(sync, "time", clock)
    run_jobs = sync._run_jobs

    def slow(*args: Any) -> Any:
        done = run_jobs(*args)
        hour[0] += 3600.0 if args[1] else 0.0  # (args[1]: the jobs of this round)
        return done

    monkeypatch.setattr(sync, "_run_jobs", slow)
    report = sync.run_sync(config)
    assert report.ok and not report.unsettled, report
    assert (mirror / "run" / "latest").read_text() == "global_step4"
    assert (mirror / "run" / "global_step4" / "mp_rank_00_model_states.pt").is_file()
