"""`mirrord sync`: one full pass - list both sides, copy what is missing or differs, report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mirrord.core.jobs import CopyJob
from mirrord.core.model import Snapshot
from mirrord.core.plan import SettleTracker
from mirrord.core.reconcile import Facts
from mirrord.errors import InvalidSourceError, ManifestError, MirrordError, SourceGoneError
from mirrord.obs.log import get_logger
from mirrord.service.engine import Engine
from mirrord.service.enqueue import copy_view
from mirrord.service.progress import ProgressBoard
from mirrord.service.workers import copy_all
from mirrord.store.aliases import alias_links
from mirrord.store.completeness import Looks
from mirrord.store.targets import mirror_for
from mirrord.store.volume import LocalVolume, exclude_each_other

if TYPE_CHECKING:
    from mirrord.config import Config


@dataclass
class SyncReport:
    """What a sync did: copied, failed, unsettled and invalid files, and listing errors."""

    copied: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unsettled: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)  # failed the format validator: not published
    gone: list[str] = field(default_factory=list)  # deleted by the trainer before they were copied: not failures
    in_sync: int = 0
    listing_errors: list[str] = field(default_factory=list)
    refused: str | None = None  # why nothing was copied: the mirror looks unmounted (as `run` refuses it)

    @property
    def ok(self) -> bool:
        """Whether everything was copied (nothing failed, invalid, unlisted or refused)."""
        return not self.failed and not self.listing_errors and not self.invalid and self.refused is None


def run_sync(config: Config, board: ProgressBoard | None = None) -> SyncReport:
    """Copy every committed checkpoint the mirror lacks. Files still being written are waited for (up to
    three settle periods after the last copies) and then reported as unsettled, not copied; a source that
    fails its format validator is tried again if it changes within that time, else reported as invalid. A mirror
    that looks unmounted is refused, as `mirrord run` refuses it: nothing is copied. `board` shows the
    copies under way to a watcher (the terminal display)."""
    log = get_logger()
    primary = LocalVolume(config.primary)
    mirror = mirror_for(config.mirror_target, config.s3)
    report = SyncReport()
    with mirror.lock():
        exclude_each_other(primary, mirror)  # as the daemon: neither listing enters the other root
        manifest = mirror.read_manifest()
        engine = Engine(config, mirror, manifest, board=board)
        rules = config.rules
        settle = SettleTracker(config.copy.settle_seconds, time.time, time.monotonic, config.unit.settle_seconds)
        looks = Looks(time.monotonic)
        patience = 3 * max(config.copy.settle_seconds, config.unit.settle_seconds * rules.folders)
        deadline = time.monotonic() + patience
        attempted: dict[str, tuple[tuple[int, int, int, int], ...]] = {}  # rel -> the source identity tried
        while True:
            psnap = primary.snapshot(config.patterns, rules)
            msnap = mirror.snapshot(config.patterns, rules)
            report.listing_errors = list(psnap.errors + msnap.errors)
            links = alias_links(psnap.skipped, rules)
            for rel, why in psnap.skipped:
                if rel not in links:  # an alias symlink (last.ckpt) is mirrored as a link below
                    log.warning("scan.skipped", path=rel, why=why, volume="primary")
            facts = Facts(mirror_is_mount=mirror.is_mountpoint(), invalid=frozenset(report.invalid))
            view = copy_view(config, primary, mirror, manifest, manifest.entries, settle, psnap, msnap, facts, looks)
            report.refused = view.refused
            if view.refused is not None:
                break
            jobs = [j for j in view.jobs if attempted.get(j.rel) != _identity(psnap, j)]
            _run_jobs(engine, jobs, config.copy_workers, report)
            attempted.update((j.rel, _identity(psnap, j)) for j in jobs)
            if jobs:  # the wait is for files to settle, counted from the last copies, however long they took
                deadline = time.monotonic() + patience
            report.in_sync = view.in_sync
            report.unsettled = list(view.unsettled)
            if not (view.unsettled or report.invalid):
                break
            if jobs and view.unsettled:
                continue  # what waited for these copies (a DeepSpeed tag file after its folders) may go now
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, config.copy.settle_seconds))
        for rel, target in mirror.link_aliases(config.primary, links, manifest.entries):
            log.info("alias.linked", path=rel, target=target)
        manifest.close()
    for msg in report.listing_errors:
        log.error("scan.error", cause=msg)
    if report.refused is not None:
        log.error("mirror.refused", cause=report.refused, mirror=mirror.describe(), check="listing")
    for rel in report.unsettled:
        log.warning("sync.unsettled", path=rel, settle_seconds=config.copy.settle_seconds)
    for rel, cause in report.invalid.items():
        log.error("copy.invalid_source", path=rel, cause=cause, published=False)
    log.info(
        "sync.finished",
        copied=len(report.copied),
        failed=len(report.failed),
        gone=len(report.gone),
        unsettled=len(report.unsettled),
        invalid=len(report.invalid),
        in_sync=report.in_sync,
    )
    return report


def _identity(psnap: Snapshot, job: CopyJob) -> tuple[tuple[int, int, int, int], ...]:
    """The source as it was planned: the file, or every file of a folder unit."""
    return tuple(psnap.files[rel].identity for rel in job.paths)


def _run_jobs(engine: Engine, jobs: list[CopyJob], workers: int, report: SyncReport) -> None:
    outcomes = copy_all(engine, jobs, workers, still_ours=engine.mirror.lock_problem)
    for job in jobs:
        outcome = outcomes.get(job.rel)
        report.invalid.pop(job.rel, None)
        if isinstance(outcome, InvalidSourceError):
            report.invalid[job.rel] = outcome.cause
        elif isinstance(outcome, SourceGoneError):
            report.gone.append(job.rel)
        elif isinstance(outcome, MirrordError):
            report.failed[job.rel] = str(outcome)
            if isinstance(outcome, ManifestError):
                raise outcome
        elif outcome is None:
            report.failed[job.rel] = (
                f"{job.rel}: not copied: the mirror lock was lost or the copy worker died (see the log)"
            )
        elif outcome.wrote:  # (else the same bytes put back: only their new identity was recorded)
            report.copied.append(job.rel)
