"""Metrics: every issue-5 name is exported, and values move as copies succeed, fail and prunes are vetoed.

Each test uses a fresh Metrics() (its own registry) and drives the real Engine and Pruner over real
torch.save files, so a value changes only because the code that owns it ran.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from mirrord.config import Config
from mirrord.core.jobs import CopyJob
from mirrord.core.model import step_of
from mirrord.errors import (
    CancelledError,
    NoSpaceError,
    PermanentError,
    SourceChangedError,
    SourceGoneError,
    StalledError,
)
from mirrord.obs import metrics as metrics_module
from mirrord.obs.metrics import COPY_RESULTS, MAX_RUN_LABELS, OTHER_RUN, PRUNE_REFUSED_REASONS, SKIP_REASONS, Metrics
from mirrord.service.copier import CopyControl
from mirrord.service.engine import Engine
from mirrord.service.pruner import Pruner
from mirrord.store.volume import LocalMirror, LocalVolume
from tests.support.checkpoints import BASE_MTIME_NS
from tests.support.engine import copy_once

ISSUE_5_NAMES = (
    "mirrord_copies_total",
    "mirrord_copied_bytes_total",
    "mirrord_copy_duration_seconds",
    "mirrord_copy_throughput_bytes_per_second",
    "mirrord_queue_depth",
    "mirrord_copies_in_flight",
    "mirrord_pruned_files_total",
    "mirrord_pruned_bytes_total",
    "mirrord_prune_skipped_total",
    "mirrord_last_mirrored_step",
    "mirrord_last_mirrored_timestamp_seconds",
    "mirrord_mirror_lag_seconds",
    "mirrord_volume_free_bytes",
    "mirrord_volume_total_bytes",
    "mirrord_verify_failures_total",
    "mirrord_reconcile_duration_seconds",
    "mirrord_watch_mode",
    "mirrord_build_info",
)
WALL = 1_800_000_000.0  # the engine's clock, injected: mirrored_at and the last-copy timestamp


def value(m: Metrics, name: str, **labels: str) -> float:
    """A sample's current value; 0 for a series that does not exist (yet)."""
    return m.registry.get_sample_value(name, labels) or 0.0


def label_values(m: Metrics, name: str, label: str) -> set[str]:
    return {s.labels[label] for fam in m.registry.collect() for s in fam.samples if s.name == name}


def job_for(primary: Path, rel: str, config: Config) -> CopyJob:
    st = (primary / rel).stat()
    return CopyJob(rel, st.st_size, st.st_mtime_ns, step_of(rel, config.step_regex), "new")


def make_engine(config: Config, m: Metrics) -> Engine:
    mirror = LocalMirror(config.mirror)
    return Engine(config, mirror, mirror.read_manifest(), m, wall=lambda: WALL)


class TouchOnFirstChunk(CopyControl):
    """A supervisor stand-in that changes the source's mtime while the copy is under way."""

    def __init__(self, source: Path) -> None:
        super().__init__()
        self.source = source

    def advance(self, n: int) -> None:
        super().advance(n)
        if self.bytes_done == n:
            os.utime(self.source, ns=(BASE_MTIME_NS, BASE_MTIME_NS + 123))


def test_every_issue_5_metric_is_exported_by_a_fresh_registry() -> None:
    """The fixed names exist from start-up, with the known label values pre-initialised at 0."""
    m = Metrics()
    text = generate_latest(m.registry).decode()
    for name in ISSUE_5_NAMES:
        assert f"# TYPE {name} " in text, name
    for result in COPY_RESULTS:
        assert f'mirrord_copies_total{{result="{result}"}} 0.0' in text
    for reason in SKIP_REASONS:
        assert f'mirrord_prune_skipped_total{{reason="{reason}"}} 0.0' in text
    for volume in ("primary", "mirror"):
        assert f'mirrord_pruned_files_total{{volume="{volume}"}} 0.0' in text
    assert value(m, "mirrord_build_info", version=metrics_module.__version__) == 1


def test_two_registries_do_not_share_values(make_config, primary, checkpoint) -> None:
    """Metrics are bound to their own registry: a test (or a second engine) never sees another's counts."""
    checkpoint(primary / "r" / "step_0001.pt", 1)
    config = make_config()
    counted, untouched = Metrics(), Metrics()
    copy_once(make_engine(config, counted), job_for(primary, "r/step_0001.pt", config))
    assert value(counted, "mirrord_copies_total", result="ok") == 1
    assert value(untouched, "mirrord_copies_total", result="ok") == 0


def test_a_copy_moves_every_copy_metric(make_config, primary, checkpoint) -> None:
    """ok +1, bytes += size, one duration observation, throughput and timestamp set, step per run."""
    src = checkpoint(primary / "run1" / "step_0007.pt", 7, width=128)
    config = make_config()
    m = Metrics()
    result = copy_once(make_engine(config, m), job_for(primary, "run1/step_0007.pt", config))
    size = src.stat().st_size
    assert result.size == size
    assert value(m, "mirrord_copies_total", result="ok") == 1
    assert sum(value(m, "mirrord_copies_total", result=r) for r in COPY_RESULTS) == 1
    assert value(m, "mirrord_copied_bytes_total") == size
    assert value(m, "mirrord_copy_duration_seconds_count") == 1
    assert value(m, "mirrord_copy_duration_seconds_sum") == pytest.approx(result.seconds)
    assert value(m, "mirrord_copy_throughput_bytes_per_second") > 0
    assert value(m, "mirrord_last_mirrored_timestamp_seconds") == WALL
    assert value(m, "mirrord_last_mirrored_step", run="run1") == 7
    assert value(m, "mirrord_copies_in_flight") == 0


def test_last_mirrored_step_is_the_highest_step_not_the_latest_copy(make_config, primary, checkpoint) -> None:
    """Copies finish newest-first; an older step copied afterwards must not lower the gauge."""
    for step in (9, 3):
        checkpoint(primary / "run1" / f"step_{step:04d}.pt", step)
    config = make_config()
    m = Metrics()
    engine = make_engine(config, m)
    copy_once(engine, job_for(primary, "run1/step_0009.pt", config))
    copy_once(engine, job_for(primary, "run1/step_0003.pt", config))
    assert value(m, "mirrord_last_mirrored_step", run="run1") == 9
    assert value(m, "mirrord_copies_total", result="ok") == 2


def test_no_space_failure_is_counted_by_its_reason(make_config, primary, mirror, checkpoint) -> None:
    """A copy refused for space counts once as no_space; nothing is published or counted as copied."""
    checkpoint(primary / "step_0001.pt", 1)
    config = make_config(copy={"free_space_reserve_bytes": 2**62})
    m = Metrics()
    with pytest.raises(NoSpaceError):
        copy_once(make_engine(config, m), job_for(primary, "step_0001.pt", config))
    assert value(m, "mirrord_copies_total", result="no_space") == 1
    assert value(m, "mirrord_copies_total", result="ok") == 0
    assert value(m, "mirrord_copied_bytes_total") == 0
    assert value(m, "mirrord_copy_duration_seconds_count") == 0
    assert value(m, "mirrord_copies_in_flight") == 0
    assert not (mirror / "step_0001.pt").exists()


def test_source_changed_during_the_copy_is_counted(make_config, primary, mirror, checkpoint) -> None:
    """The trainer touching the file mid-copy gives result="source_changed", not ok and not failed."""
    src = checkpoint(primary / "step_0002.pt", 2, width=256)
    config = make_config(io={"buffer_bytes": 64 * 1024})
    m = Metrics()
    with pytest.raises(SourceChangedError):
        copy_once(make_engine(config, m), job_for(primary, "step_0002.pt", config), TouchOnFirstChunk(src))
    assert value(m, "mirrord_copies_total", result="source_changed") == 1
    assert value(m, "mirrord_copies_total", result="ok") == 0
    assert value(m, "mirrord_last_mirrored_step", run=".") == 0
    assert not (mirror / "step_0002.pt").exists()


def test_a_vanished_source_counts_as_source_gone(make_config, primary, checkpoint) -> None:
    """Rotated away by the trainer before it was copied: result="source_gone", not failed."""
    checkpoint(primary / "step_0003.pt", 3)
    config = make_config()
    job = job_for(primary, "step_0003.pt", config)
    (primary / "step_0003.pt").unlink()
    m = Metrics()
    with pytest.raises(SourceGoneError, match="deleted before it was copied"):
        copy_once(make_engine(config, m), job)
    assert value(m, "mirrord_copies_total", result="source_gone") == 1
    assert value(m, "mirrord_copies_total", result="failed") == 0


def test_an_error_without_a_reason_counts_as_failed(make_config, primary, checkpoint) -> None:
    """An error without a more specific reason lands in result="failed" (a FIFO where a file was listed)."""
    checkpoint(primary / "step_0003.pt", 3)
    config = make_config()
    job = job_for(primary, "step_0003.pt", config)
    (primary / "step_0003.pt").unlink()
    os.mkfifo(primary / "step_0003.pt")
    m = Metrics()
    with pytest.raises(PermanentError, match="not a regular file"):
        copy_once(make_engine(config, m), job)
    assert value(m, "mirrord_copies_total", result="failed") == 1


@pytest.mark.parametrize(("reason", "error"), [("cancelled", CancelledError), ("stalled", StalledError)])
def test_cancelled_and_stalled_copies_are_not_counted_by_the_engine(
    make_config, primary, checkpoint, reason: str, error: type[Exception]
) -> None:
    """Shutdown is not a failure; a stall is counted once, by the supervisor that detected it."""
    checkpoint(primary / "step_0004.pt", 4)
    config = make_config()
    control = CopyControl()
    control.stop(reason)
    m = Metrics()
    with pytest.raises(error):
        copy_once(make_engine(config, m), job_for(primary, "step_0004.pt", config), control)
    assert sum(value(m, "mirrord_copies_total", result=r) for r in COPY_RESULTS) == 0
    assert value(m, "mirrord_copies_in_flight") == 0


def _mirrored_run(
    make_config: Callable[..., Config],
    primary: Path,
    checkpoint: Callable[..., Path],
    m: Metrics,
    prune: dict[str, object] | None = None,
) -> tuple[Config, list[Path]]:
    """Four checkpoints of run "r", really copied and recorded, with prune.keep_last = 1."""
    files = [checkpoint(primary / "r" / f"step_{s:04d}.pt", s) for s in range(1, 5)]
    config = make_config(prune={"keep_last": 1, "min_age_seconds": 300, **(prune or {})})
    engine = make_engine(config, m)
    for f in files:
        copy_once(engine, job_for(primary, f.relative_to(primary).as_posix(), config))
    return config, files


def test_prune_skip_counts_the_guard_reason(make_config, primary, mirror, checkpoint) -> None:
    """Files too young to delete are skipped with reason recent_mtime, counted once each, none deleted."""
    m = Metrics()
    config, files = _mirrored_run(make_config, primary, checkpoint, m)
    just_after = BASE_MTIME_NS / 1e9 + 10  # the checkpoints' mtimes are BASE + step seconds
    pruner = Pruner(
        config,
        LocalVolume(primary),
        LocalMirror(mirror),
        LocalMirror(mirror).read_manifest(),
        m,
        wall=lambda: just_after,
    )
    report = pruner.run_cycle()
    assert [s.reason for s in report.skipped] == ["recent_mtime"] * 3
    assert value(m, "mirrord_prune_skipped_total", reason="recent_mtime") == 3
    assert sum(value(m, "mirrord_prune_skipped_total", reason=r) for r in SKIP_REASONS) == 3
    assert value(m, "mirrord_pruned_files_total", volume="mirror") == 0
    assert all((mirror / f.relative_to(primary)).exists() for f in files)


def test_prune_skips_for_in_flight_and_future_mtime(make_config, primary, mirror, checkpoint) -> None:
    """A path being copied is vetoed as in_flight; with a clock far behind, the rest are future_mtime."""
    m = Metrics()
    config, _ = _mirrored_run(make_config, primary, checkpoint, m)
    volume = LocalMirror(mirror)
    pruner = Pruner(
        config,
        LocalVolume(primary),
        volume,
        volume.read_manifest(),
        m,
        wall=lambda: BASE_MTIME_NS / 1e9 - 3600,
        in_flight=lambda: frozenset({"r/step_0001.pt"}),
    )
    pruner.run_cycle()
    assert value(m, "mirrord_prune_skipped_total", reason="in_flight") == 1
    assert value(m, "mirrord_prune_skipped_total", reason="future_mtime") == 2
    assert value(m, "mirrord_pruned_files_total", volume="mirror") == 0


def test_prune_deletions_count_files_and_bytes_per_volume(make_config, primary, mirror, checkpoint) -> None:
    """Old, verified steps below keep_last are deleted on the mirror; files and bytes counted there only."""
    m = Metrics()
    config, files = _mirrored_run(make_config, primary, checkpoint, m)
    volume = LocalMirror(mirror)
    pruner = Pruner(config, LocalVolume(primary), volume, volume.read_manifest(), m, wall=lambda: WALL)
    report = pruner.run_cycle()
    freed = sum(f.stat().st_size for f in files[:3])
    assert len(report.deleted) == 3
    assert value(m, "mirrord_pruned_files_total", volume="mirror") == 3
    assert value(m, "mirrord_pruned_bytes_total", volume="mirror") == freed
    assert value(m, "mirrord_pruned_files_total", volume="primary") == 0
    assert sum(value(m, "mirrord_prune_skipped_total", reason=r) for r in SKIP_REASONS) == 0


def test_primary_pruning_is_counted_under_its_own_label(make_config, primary, mirror, checkpoint) -> None:
    """With prune.primary = true the same steps go on the primary, counted with volume="primary"."""
    m = Metrics()
    config, _ = _mirrored_run(make_config, primary, checkpoint, m, {"primary": True})
    volume = LocalMirror(mirror)
    Pruner(config, LocalVolume(primary), volume, volume.read_manifest(), m, wall=lambda: WALL).run_cycle()
    assert value(m, "mirrord_pruned_files_total", volume="primary") == 3
    assert value(m, "mirrord_pruned_files_total", volume="mirror") == 3
    assert sorted(p.name for p in (primary / "r").iterdir()) == ["step_0004.pt"]


def test_run_labels_are_capped(monkeypatch, make_config, primary, checkpoint) -> None:
    """Past MAX_RUN_LABELS distinct runs, last_mirrored_step reports the rest under one "_other" label."""
    monkeypatch.setattr(metrics_module, "MAX_RUN_LABELS", 2)
    for i, run in enumerate(("a", "b", "c", "d"), start=1):
        checkpoint(primary / run / f"step_{i:04d}.pt", i)
    config = make_config()
    m = Metrics()
    engine = make_engine(config, m)
    for i, run in enumerate(("a", "b", "c", "d"), start=1):
        copy_once(engine, job_for(primary, f"{run}/step_{i:04d}.pt", config))
    assert label_values(m, "mirrord_last_mirrored_step", "run") == {"a", "b", OTHER_RUN}
    assert value(m, "mirrord_last_mirrored_step", run=OTHER_RUN) == 4
    assert value(m, "mirrord_copies_total", result="ok") == 4


def test_run_label_cap_holds_for_many_runs() -> None:
    """The default cap: 100 runs keep their names, a known run keeps it forever, the rest share one."""
    m = Metrics()
    labels = [m.run_label(f"run{i:03d}") for i in range(MAX_RUN_LABELS + 50)]
    assert labels[:MAX_RUN_LABELS] == [f"run{i:03d}" for i in range(MAX_RUN_LABELS)]
    assert set(labels[MAX_RUN_LABELS:]) == {OTHER_RUN}
    assert m.run_label("run000") == "run000"


def test_the_root_run_is_labelled_dot() -> None:
    """Checkpoints directly in the root belong to run "." (an empty label would be confusing)."""
    assert Metrics().run_label("") == "."


def test_unknown_copy_result_is_folded_into_failed() -> None:
    """The result label set is fixed: an unexpected reason cannot create a new series."""
    m = Metrics()
    m.copy_result("manifest")
    m.copy_result("locked")
    assert value(m, "mirrord_copies_total", result="failed") == 2
    assert label_values(m, "mirrord_copies_total", "result") == set(COPY_RESULTS)


def test_prune_refusals_start_at_zero_and_unknown_reasons_count_as_failed() -> None:
    """Like every labelled counter: a series per known reason from the start, and a bounded label set."""
    m = Metrics()
    assert label_values(m, "mirrord_prune_refused_total", "reason") == set(PRUNE_REFUSED_REASONS)
    m.prune_refusal("changed")
    m.prune_refusal("stale_handle_nobody_listed")
    assert value(m, "mirrord_prune_refused_total", reason="changed") == 1
    assert value(m, "mirrord_prune_refused_total", reason="failed") == 1
    assert label_values(m, "mirrord_prune_refused_total", "reason") == set(PRUNE_REFUSED_REASONS)


def test_no_created_series_and_runtime_collectors() -> None:
    """The exposition has process_* and python_* families and no *_created samples."""
    text = generate_latest(Metrics().registry).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert not [n for n in names if n.endswith("_created")]
    assert {"process_resident_memory_bytes", "process_open_fds", "python_info", "python_gc_collections_total"} <= names
