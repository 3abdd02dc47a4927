"""One in-process planning pass over folder units and its copies, against any mirror (local or S3):
what `mirrord sync` does, without the process, so tests can look at the engine's results directly."""

from __future__ import annotations

from mirrord.config import Config
from mirrord.core.plan import plan_unit_copies
from mirrord.service.engine import Engine
from mirrord.store.completeness import judge
from mirrord.store.mirror import Mirror
from mirrord.store.volume import LocalVolume
from tests.support.engine import copy_once


def sync_units(config: Config, mirror: Mirror) -> int:
    """Plan the unit copies from both snapshots and make each once; returns how many jobs ran."""
    primary = LocalVolume(config.primary)
    with mirror.lock():
        manifest = mirror.read_manifest()
        engine = Engine(config, mirror, manifest)
        psnap = primary.snapshot(config.patterns, config.rules)
        msnap = mirror.snapshot(config.patterns, config.rules)
        plan = plan_unit_copies(psnap, msnap, manifest.entries, config.rules, judge(primary, config.rules))
        for job in plan.jobs:
            copy_once(engine, job)
        manifest.close()
    return len(plan.jobs)
