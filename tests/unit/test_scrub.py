"""The scrub's judgement of one pass, in process (the daemon's thread and pacing: tests/integration/test_scrub.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mirrord.config import Config, load_config
from mirrord.core.jobs import CopyJob
from mirrord.obs.metrics import Metrics
from mirrord.service.engine import Engine
from mirrord.service.scrub import Scrubber
from mirrord.store.manifest import Manifest
from mirrord.store.resume import latest_checkpoint
from mirrord.store.volume import LocalMirror
from tests.support.checkpoints import BASE_MTIME_NS
from tests.support.engine import copy_once
from tests.support.folders import write_hf
from tests.support.unitsync import sync_units
from tests.unit.test_latest import mirror_steps


def test_rot_that_no_stat_shows_is_kept_and_latest_passes_over_it(make_config: Callable[..., Config]) -> None:
    """The newest copy's bytes no longer hash to its record while its inode, size, mtime and ctime are as
    recorded (the record's digest is changed here: no write can leave the ctime alone), and its primary is
    gone: the scrub keeps it, counts it, and `latest`, which trusted its stat, now reads it again and answers
    with the step before."""
    config = make_config(copy={"free_space_reserve_bytes": 0})
    mirror_steps(config, [("run/step_1.pt", 1, BASE_MTIME_NS), ("run/step_2.pt", 2, BASE_MTIME_NS + 10**9)])
    (config.primary / "run/step_2.pt").unlink()
    mirror = LocalMirror(config.mirror)
    manifest = mirror.read_manifest()
    manifest.record(replace(manifest.entries["run/step_2.pt"], digest="0" * 64))
    assert latest_checkpoint(config.mirror) == config.mirror / "run/step_2.pt"  # trusted by its stat
    metrics, repairs = Metrics(runtime=False), []
    scrubber = Scrubber(lambda: config, mirror, manifest, metrics, frozenset, lambda: False, repairs.append)
    scrubber.scrub_pass(seconds=1e-6)
    scrubber.scrub_pass(seconds=1e-6)
    assert repairs == []
    assert (config.mirror / "run/step_2.pt").exists() and "run/step_2.pt" in manifest.entries
    assert metrics.registry.get_sample_value("mirrord_damaged_copies") == 1
    assert latest_checkpoint(config.mirror) == config.mirror / "run/step_1.pt"
    manifest.close()


def test_a_damaged_file_of_a_folder_unit_is_copied_again_with_its_whole_unit(tmp_path: Path) -> None:
    """One file of a mirrored HF checkpoint folder rots (mtime put back); its primary is intact: the scrub
    asks for the copy of the whole folder, every file of it, and that copy makes the mirror whole again."""
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    write_hf(primary / "run" / "checkpoint-5", 5)
    config = load_config(
        environ={},
        overrides={"primary": str(primary), "mirror": str(mirror_root), "layout": "hf", "copy": {"settle_seconds": 0}},
        check_roots=False,
    )
    mirror = LocalMirror(config.mirror)
    assert sync_units(config, mirror) == 1
    files = sorted(p.relative_to(primary).as_posix() for p in primary.rglob("*") if p.is_file())
    rotten = mirror_root / files[-1]
    st, data = rotten.stat(), bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 1
    rotten.write_bytes(bytes(data))
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
    with mirror.lock():
        manifest = mirror.read_manifest()
        repairs: list[CopyJob] = []
        Scrubber(
            lambda: config, mirror, manifest, Metrics(runtime=False), frozenset, lambda: False, repairs.append
        ).scrub_pass(1e-6)
        assert [(job.rel, job.members) for job in repairs] == [("run/checkpoint-5", tuple(files))]
        copy_once(Engine(config, mirror, manifest), repairs[0])
        manifest.close()
    assert all((mirror_root / rel).read_bytes() == (primary / rel).read_bytes() for rel in files)
    assert sorted(Manifest.load(mirror_root).entries) == files
