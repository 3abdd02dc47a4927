"""`latest`: only verified checkpoints, trusted by stat without re-reading, newest branch first, runs by mtime."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

import mirrord.store.resume as latest_module
from mirrord.config import Config
from mirrord.core.jobs import CopyJob
from mirrord.obs.metrics import Metrics
from mirrord.service.engine import Engine
from mirrord.store.manifest import Manifest
from mirrord.store.resume import latest_checkpoint
from mirrord.store.volume import LocalMirror
from tests.support.checkpoints import BASE_MTIME_NS, save_checkpoint
from tests.support.engine import copy_once


def mirror_steps(config: Config, rels_and_steps: list[tuple[str, int, int]]) -> None:
    """torch.save each (rel, step, mtime_ns) on the primary and copy it with the real engine."""
    mirror = LocalMirror(config.mirror)
    manifest = mirror.read_manifest()
    engine = Engine(config, mirror, manifest, Metrics())
    for rel, step, mtime_ns in rels_and_steps:
        path = save_checkpoint(config.primary / rel, step, mtime_ns=mtime_ns)
        # seen: as the queue sets it, the last recording sequence when the job was listed (one at a time here)
        copy_once(engine, CopyJob(rel, path.stat().st_size, mtime_ns, step, "new", seen=manifest.last_seq))
    manifest.close()


@pytest.fixture
def config(make_config: Callable[..., Config]) -> Config:
    return make_config(copy={"free_space_reserve_bytes": 0})


def test_a_recorded_unchanged_file_is_trusted_without_reading_it(config: Config, monkeypatch: Any) -> None:
    mirror_steps(config, [("run/step_1.pt", 1, BASE_MTIME_NS), ("run/step_2.pt", 2, BASE_MTIME_NS + 10**9)])
    [entry] = [e for e in Manifest.load(config.mirror).entries.values() if e.step == 2]
    assert entry.validation == "ok" and entry.mirror_ino and entry.mirror_ctime_ns

    def no_read(*args: Any) -> Any:
        raise AssertionError("latest re-read a file whose inode, size, mtime and ctime are as recorded")

    monkeypatch.setattr(latest_module, "check_entry", no_read)
    monkeypatch.setattr(latest_module, "validate_key", no_read)
    assert latest_checkpoint(config.mirror) == config.mirror / "run/step_2.pt"


def test_a_file_changed_since_it_was_recorded_is_re_read_and_skipped_if_damaged(config: Config) -> None:
    mirror_steps(config, [("run/step_1.pt", 1, BASE_MTIME_NS), ("run/step_2.pt", 2, BASE_MTIME_NS + 10**9)])
    newest = config.mirror / "run/step_2.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 1  # same size, mtime restored: only the ctime (and the hash) tell
    newest.write_bytes(bytes(data))
    os.utime(newest, ns=(BASE_MTIME_NS + 10**9, BASE_MTIME_NS + 10**9))
    assert latest_checkpoint(config.mirror) == config.mirror / "run/step_1.pt"


def test_verify_re_reads_even_an_unchanged_file(config: Config, monkeypatch: Any) -> None:
    mirror_steps(config, [("run/step_1.pt", 1, BASE_MTIME_NS)])
    calls: list[str] = []
    real = latest_module.check_entry
    monkeypatch.setattr(latest_module, "check_entry", lambda root, e: calls.append(e.path) or real(root, e))
    assert latest_checkpoint(config.mirror, verify=True) == config.mirror / "run/step_1.pt"
    assert calls == ["run/step_1.pt"]


def test_after_a_rollback_the_newest_branch_wins(config: Config) -> None:
    """Steps 2, 4, 6 written, then the trainer went back and wrote 3: step 3 is the one to resume."""
    t = BASE_MTIME_NS
    mirror_steps(
        config,
        [
            ("run/step_2.pt", 2, t),
            ("run/step_4.pt", 4, t + 10**9),
            ("run/step_6.pt", 6, t + 2 * 10**9),
            ("run/step_3.pt", 3, t + 3 * 10**9),
        ],
    )
    assert latest_checkpoint(config.mirror) == config.mirror / "run/step_3.pt"


def test_without_run_the_run_written_last_wins_whatever_its_step_numbers(config: Config) -> None:
    t = BASE_MTIME_NS
    mirror_steps(config, [("old/step_9000.pt", 9000, t), ("new/step_10.pt", 10, t + 10**9)])
    assert latest_checkpoint(config.mirror) == config.mirror / "new/step_10.pt"
    assert latest_checkpoint(config.mirror, run="old") == config.mirror / "old/step_9000.pt"
