"""The shipped Grafana dashboard and the PodMonitor, against a real Prometheus scraping a real daemon.

Every panel's PromQL is run by Prometheus' query API once the daemon has mirrored a checkpoint: a query
Prometheus rejects, or one that returns no series, fails (a renamed metric would leave a panel empty).
The scrape is configured as the Prometheus Operator makes it from config/kubernetes/podmonitor.yaml (job
named NAMESPACE/NAME, then the PodMonitor's relabelings), so the alert rules' `up{job="mirrord"}` is
checked against the labels a cluster really gives.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from mirrord.store.manifest import Manifest
from tests.integration.test_prometheus_e2e import PrometheusServer
from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "mirrord" / "data" / "grafana" / "mirrord.json"
PODMONITOR = REPO / "config" / "kubernetes" / "podmonitor.yaml"
ALERTS = REPO / "config" / "prometheus" / "alerts.yml"


def _snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def operator_scrape_config() -> dict[str, Any]:
    """What the Operator generates for the PodMonitor's endpoint: its job name and relabelings."""
    monitor = yaml.safe_load(PODMONITOR.read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabel = [{_snake(k): v for k, v in rule.items()} for rule in endpoint.get("relabelings", [])]
    return {"job_name": f"default/{monitor['metadata']['name']}", "relabel_configs": relabel}


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    """Lag per run, copies and failures, bytes in flight, free space, prune skips by reason, invalid sources,
    the mirror files retention keeps beyond its policy by reason, paused runs, each run's last drill (passed or
    failed), the scrub's reads and its last complete pass, and damaged copies."""
    exprs = " ".join(expr for _, expr in panel_queries())
    for metric in (
        "mirrord_mirror_lag_seconds",
        "mirrord_last_mirrored_step",
        "mirrord_copies_total",
        "mirrord_copy_bytes_in_flight",
        "mirrord_volume_free_bytes",
        "mirrord_prune_skipped_total",
        "mirrord_invalid_sources",
        "mirrord_retention_held_files",
        "mirrord_runs_paused",
        "mirrord_drill_last_success_timestamp_seconds",
        "mirrord_drill_last_failure_timestamp_seconds",
        "mirrord_scrub_bytes_total",
        "mirrord_scrub_last_complete_timestamp_seconds",
        "mirrord_damaged_copies",
    ):
        assert metric in exprs, metric


def test_every_panel_query_returns_series_from_a_real_daemon(tmp_path: Path, daemon_factory: Any) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    # (the tests' default: no drills, no scrub)
    daemon = daemon_factory({"drill": {"interval_hours": 24}, "scrub": {"interval_days": 7}}).start()
    prometheus = PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{daemon.port}"], operator_scrape_config())
    try:
        publish_checkpoint(primary / "run1" / "step_0010.pt", 10, megabytes=2)
        wait_for(lambda: "run1/step_0010.pt" in Manifest.load(mirror).entries, 90, "step 10 mirrored")
        # The alert rules' selector matches what the PodMonitor's scrape gives.
        [(labels, up)] = prometheus.wait_query('up{job="mirrord"}', timeout=60)
        assert up == 1 and labels["job"] == "mirrord"
        assert 'up{job="mirrord"}' in ALERTS.read_text()
        prometheus.wait_query('mirrord_last_mirrored_step{run="run1"} == 10', timeout=60)
        prometheus.wait_query('mirrord_drill_last_success_timestamp_seconds{run="run1"}', timeout=120)  # step 10 loads
        prometheus.wait_query("count_over_time(mirrord_build_info[5m]) >= 3", timeout=60)  # rate() needs 2 samples
        empty = []
        for title, expr in panel_queries():
            if not prometheus.query(expr):  # an invalid query fails inside query(): status is not success
                empty.append(f"{title}: {expr}")
        assert not empty, f"panels with no data: {empty}"
    finally:
        prometheus.stop()
