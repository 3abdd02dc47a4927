"""The scrub's judgement of one pass, in process (the daemon's thread and pacing: tests/integration/test_scrub.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mirrord.config import Config
from mirrord.obs.metrics import Metrics
from mirrord.service.scrub import Scrubber
from mirrord.store.resume import latest_checkpoint
from mirrord.store.volume import LocalMirror
from tests.support.checkpoints import BASE_MTIME_NS
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
