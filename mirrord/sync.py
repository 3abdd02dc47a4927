"""`mirrord sync`: one full pass - list both sides, copy what is missing or differs, report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mirrord.config import Config
from mirrord.engine import Engine
from mirrord.errors import InvalidSourceError, ManifestError, MirrordError
from mirrord.log import get_logger
from mirrord.metrics import Metrics
from mirrord.model import CopyJob
from mirrord.plan import SettleTracker, plan_copies
from mirrord.progress import ProgressBoard
from mirrord.prune import Pruner
from mirrord.volume import LocalMirror, LocalVolume
from mirrord.workers import copy_all


@dataclass
class SyncReport:
    copied: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unsettled: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)  # failed the format validator: not published
    in_sync: int = 0
    listing_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.listing_errors and not self.invalid


def run_sync(config: Config, metrics: Metrics | None = None, board: ProgressBoard | None = None) -> SyncReport:
    """Copy every committed checkpoint the mirror lacks. Files still being written are waited for
    (up to three settle periods) and then reported as unsettled, not copied; a source that fails its
    format validator is tried again if it changes within that time, else reported as invalid. `board`
    shows the copies under way to a watcher (the terminal display)."""
    log = get_logger()
    primary = LocalVolume(config.primary)
    mirror = LocalMirror(config.mirror)
    report = SyncReport()
    with mirror.lock():
        manifest = mirror.read_manifest()
        engine = Engine(config, mirror, manifest, metrics, board=board)
        pruner = Pruner(config, primary, mirror, manifest, engine.metrics,
                        invalid=lambda: frozenset(report.invalid)) if config.prune.enabled else None
        settle = SettleTracker(config.copy.settle_seconds, time.time, time.monotonic)
        deadline = time.monotonic() + 3 * config.copy.settle_seconds
        attempted: dict[str, tuple[int, int, int, int]] = {}  # rel -> the source identity tried
        while True:
            psnap = primary.snapshot(config.patterns)
            msnap = mirror.snapshot(config.patterns)
            report.listing_errors = list(psnap.errors + msnap.errors)
            for rel, why in psnap.skipped:
                log.warning("scan.skipped", path=rel, why=why, volume="primary")
            plan = plan_copies(psnap, msnap, manifest.entries, config.step_regex, settle.at(time.monotonic()))
            if pruner is not None:
                pruner.plan(psnap, msnap)  # which old steps retention has retired: not worth copying again
            jobs = [j for j in plan.jobs if attempted.get(j.rel) != psnap.files[j.rel].identity
                    and not (pruner and pruner.retired(j.run, j.step, j.mtime_ns))]
            _run_jobs(engine, jobs, config.copy.workers, report)
            attempted.update((j.rel, psnap.files[j.rel].identity) for j in jobs)
            report.in_sync = plan.in_sync
            report.unsettled = list(plan.unsettled)
            if not (plan.unsettled or report.invalid) or time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, config.copy.settle_seconds))
        manifest.close()
    for msg in report.listing_errors:
        log.error("scan.error", cause=msg)
    for rel in report.unsettled:
        log.warning("sync.unsettled", path=rel, settle_seconds=config.copy.settle_seconds)
    for rel, cause in report.invalid.items():
        log.error("copy.invalid_source", path=rel, cause=cause, published=False)
    log.info(
        "sync.finished", copied=len(report.copied), failed=len(report.failed),
        unsettled=len(report.unsettled), invalid=len(report.invalid), in_sync=report.in_sync,
    )
    return report


def _run_jobs(engine: Engine, jobs: list[CopyJob], workers: int, report: SyncReport) -> None:
    lock_problem = getattr(engine.mirror, "lock_problem", None)
    outcomes = copy_all(engine, jobs, workers, still_ours=lock_problem)
    for job in jobs:
        outcome = outcomes.get(job.rel)
        report.invalid.pop(job.rel, None)
        if isinstance(outcome, InvalidSourceError):
            report.invalid[job.rel] = outcome.cause
        elif isinstance(outcome, MirrordError):
            report.failed[job.rel] = str(outcome)
            if isinstance(outcome, ManifestError):
                raise outcome
        elif outcome is not None:
            report.copied.append(job.rel)
        else:
            report.failed[job.rel] = (f"{job.rel}: not copied: the mirror lock was lost or the copy worker "
                                      "died (see the log)")
