"""Prometheus metrics. Names follow namespace_name_unit; every metric lives in an injectable registry."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mirrord import __version__
from mirrord.vocabulary import CopyOutcome, Held, PruneRefusal, Veto, Volume

# `*_created` series (one timestamp per counter and label set) double the series count and answer a
# question nobody asks of mirrord; the setting is process-wide in prometheus_client.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Label sets, derived from the vocabulary (mirrord.vocabulary), never typed again here.
COPY_RESULTS = tuple(CopyOutcome)
SKIP_REASONS = tuple(Veto)
PRUNE_REFUSED_REASONS = tuple(PruneRefusal)  # whole cycles and single files refused by retention
VOLUMES = tuple(Volume)
# 1 MB .. 10 GB files at 10 MB/s .. 2 GB/s: from a few ms to many minutes.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)
MAX_RUN_LABELS = 100
OTHER_RUN = "_other"


class Metrics:
    """All of mirrord's metrics, bound to one registry (a fresh one per test)."""

    def __init__(self, registry: CollectorRegistry | None = None, runtime: bool = True) -> None:
        """runtime: also export process_* (CPU, memory, fds) and python_* (GC, version) like any exporter."""
        r = self.registry = registry if registry is not None else CollectorRegistry()
        if runtime and r is not prometheus_client.REGISTRY:  # the global one already has them
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        # Every metric in this registry.
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        self.copies = counter("mirrord_copies", "Copy attempts by result.", ["result"])
        self.copied_bytes = counter("mirrord_copied_bytes", "Bytes published on the mirror.")
        self.copy_duration = Histogram(
            "mirrord_copy_duration_seconds",
            "Time to copy, verify and publish one file.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.copy_throughput = gauge(
            "mirrord_copy_throughput_bytes_per_second", "Throughput of the last completed copy."
        )
        self.in_flight = gauge("mirrord_copies_in_flight", "Copies being made right now.")
        # Set to a function by the Engine (computed at scrape time); with mirrord_copied_bytes_total it
        # gives a progress curve that moves during a long copy, not only when it is published.
        self.copy_bytes_in_flight = gauge(
            "mirrord_copy_bytes_in_flight", "Bytes already copied by the copies under way (0 when idle)."
        )
        self.pruned_files = counter("mirrord_pruned_files", "Files deleted by retention.", ["volume"])
        self.pruned_bytes = counter("mirrord_pruned_bytes", "Bytes freed by retention.", ["volume"])
        self.prune_skipped = counter("mirrord_prune_skipped", "Deletions vetoed by a guard, by reason.", ["reason"])
        self.prune_refused = counter(
            "mirrord_prune_refused",
            "Prune cycles (partial_view, mirror_unmounted, manifest) or single deletions (changed, ...) "
            "refused, by reason.",
            ["reason"],
        )
        self.last_step = gauge("mirrord_last_mirrored_step", "Highest step mirrored, per run.", ["run"])
        self.last_timestamp = gauge("mirrord_last_mirrored_timestamp_seconds", "Unix time of the last published copy.")
        self.free_bytes = gauge("mirrord_volume_free_bytes", "Free bytes per volume.", ["volume"])
        self.total_bytes = gauge("mirrord_volume_total_bytes", "Size of each volume.", ["volume"])
        self.invalid_sources = gauge(
            "mirrord_invalid_sources",
            "Primary files that failed their format validator for longer than copy.invalid_grace_seconds "
            "(not published).",
        )
        self.verify_failures = counter("mirrord_verify_failures", "Mirrored files that no longer match the manifest.")
        self.drill_last_success = gauge(
            "mirrord_drill_last_success_timestamp_seconds",
            "Unix time of the last drill that restored the run's newest checkpoint and loaded it.",
            ["run"],
        )
        self.drill_last_failure = gauge(
            "mirrord_drill_last_failure_timestamp_seconds",
            "Unix time of the last drill of the run's newest checkpoint that failed to restore or load.",
            ["run"],
        )
        self.drill_failures = counter(
            "mirrord_drill_failures", "Drills of the run's newest checkpoint that failed to restore or load.", ["run"]
        )
        self.backoff_seconds = counter(
            "mirrord_backoff_seconds",
            "Seconds copies and the scrub waited because others needed the device or a CPU (pressure stall "
            "information), or paced without that evidence.",
        )
        self.scrub_bytes = counter("mirrord_scrub_bytes", "Bytes of mirror copies re-read by the scrub.")
        self.scrub_last_complete = gauge(
            "mirrord_scrub_last_complete_timestamp_seconds", "Unix time the scrub last finished reading the mirror."
        )
        # Set to a function by the scrub (mirrord.service.scrub).
        self.damaged_copies = gauge(
            "mirrord_damaged_copies",
            "Mirror copies the scrub found not to hold their recorded bytes, that the primary no longer holds.",
        )
        self.manifest_repairs = counter(
            "mirrord_manifest_repairs",
            "Times the on-disk manifest was found damaged or replaced and rewritten from memory.",
        )
        self.copy_loops = gauge(
            "mirrord_copy_loop_files",
            "Files no longer re-copied: copied again and again with the same result (see status).",
        )
        self.reconcile_duration = gauge("mirrord_reconcile_duration_seconds", "Duration of the last full reconcile.")
        # Set to a function by the daemon (read at scrape time: it must answer while the store hangs).
        self.mirror_writable = gauge(
            "mirrord_mirror_writable",
            "1 while publishing to the mirror is safe; 0 while it is paused (an object store's lease not "
            "renewed in time, or lost).",
        )
        self.watch_mode = gauge("mirrord_watch_mode", "1 for the watch mode in use.", ["mode"])
        self.build_info = gauge("mirrord_build_info", "Version of mirrord.", ["version"])
        self.build_info.labels(__version__).set(1)
        self.live = LiveState()
        r.register(self.live)
        for result in COPY_RESULTS:
            self.copies.labels(result)
        for veto in SKIP_REASONS:
            self.prune_skipped.labels(veto)
        for refusal in PRUNE_REFUSED_REASONS:
            self.prune_refused.labels(refusal)
        for volume in VOLUMES:
            self.pruned_files.labels(volume)
            self.pruned_bytes.labels(volume)
        self._runs: set[str] = set()
        self._runs_lock = threading.Lock()

    def run_label(self, run: str) -> str:
        """Bounded label set: the first MAX_RUN_LABELS runs get their own label, later ones share one."""
        run = run or "."
        with self._runs_lock:
            if run in self._runs:
                return run
            if len(self._runs) < MAX_RUN_LABELS:
                self._runs.add(run)
                return run
        return OTHER_RUN

    def copy_result(self, reason: str) -> None:
        """Count one copy outcome (bounded labels: an unexpected reason is counted as failed)."""
        self.copies.labels(reason if reason in COPY_RESULTS else CopyOutcome.FAILED).inc()

    def prune_refusal(self, reason: str) -> None:
        """Bounded labels: an unexpected error's reason is counted as failed."""
        self.prune_refused.labels(reason if reason in PRUNE_REFUSED_REASONS else PruneRefusal.FAILED).inc()


def _nothing() -> float:
    return 0.0


def _none_held() -> tuple[int, Mapping[str, int]]:
    return 0, {}


class LiveState(Collector):
    """Gauges of current state, computed when /metrics is scraped (client_python's custom collector
    pattern), so they are never a value pushed seconds ago: `mirrord_queue_depth` drops the moment a
    worker takes a job. The daemon points the readers at its queue and lag; they must be thread-safe
    and quick (the HTTP thread calls them). 0 until then (a one-shot command has no queue). `held`: the runs
    paused and the mirror files kept by each Held reason, as the last retention pass saw them."""

    def __init__(self) -> None:
        self.queue_depth: Callable[[], float] = _nothing
        self.lag_seconds: Callable[[], float] = _nothing
        self.held: Callable[[], tuple[int, Mapping[str, int]]] = _none_held

    def read(
        self,
        queue_depth: Callable[[], float],
        lag_seconds: Callable[[], float],
        held: Callable[[], tuple[int, Mapping[str, int]]] = _none_held,
    ) -> None:
        """Read the queue depth, the lag and what retention holds through these functions from now on."""
        self.queue_depth, self.lag_seconds, self.held = queue_depth, lag_seconds, held

    def collect(self) -> Iterator[Metric]:
        """The gauges with their values now (called by each scrape)."""
        yield from self._families(self.queue_depth(), self.lag_seconds(), *self.held())

    def describe(self) -> Iterator[Metric]:
        """The names only (registration checks them), without calling the readers."""
        yield from self._families(0.0, 0.0, *_none_held())

    @staticmethod
    def _families(depth: float, lag: float, paused: int, held: Mapping[str, int]) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "mirrord_runs_paused",
            "Runs whose newest verified checkpoint is gone from the primary: their mirror is not shrunk.",
            value=paused,
        )
        files = GaugeMetricFamily(
            "mirrord_retention_held_files",
            "Mirror files retention keeps beyond its policy, by reason (paused, unconfirmed, branch_tip, pointer, "
            "not_rotated).",
            labels=["reason"],
        )
        for reason in Held:
            files.add_metric([reason], held.get(reason, 0))
        yield files
        yield GaugeMetricFamily("mirrord_queue_depth", "Copy jobs waiting for a worker.", value=depth)
        yield GaugeMetricFamily(
            "mirrord_mirror_lag_seconds",
            "Age of the oldest committed checkpoint not yet mirrored (0 when caught up).",
            value=lag,
        )
