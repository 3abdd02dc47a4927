"""End to end: a real Prometheus server scrapes a real `mirrord run`, and its HTTP API sees the mirror work.

Prometheus comes from Debian's `prometheus` package (.ci/run installs it). Each test starts its own
server on 127.0.0.1 with a free port, a temporary config (scraping every second, loading the shipped
alert rules) and a temporary TSDB, and stops it at teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mirrord.store.manifest import Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_port
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
ALERT_RULES = REPO / "config" / "prometheus" / "alerts.yml"
SCRAPE_SECONDS = 1


class PrometheusServer:
    """One Prometheus process scraping `targets` as job "mirrord" (the name the alert rules expect)."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        scrape_config: dict[str, Any] | None = None,
        rules: Path = ALERT_RULES,
    ) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: apt-get install prometheus (done by .ci/run)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "prometheus.yml"
        self.log_path = workdir / "prometheus.log"
        # JSON is YAML: no YAML library needed to write the config.
        self.config_path.write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": f"{SCRAPE_SECONDS}s",
                        "scrape_timeout": f"{SCRAPE_SECONDS}s",
                        "evaluation_interval": f"{SCRAPE_SECONDS}s",
                    },
                    "rule_files": [str(rules)],
                    "scrape_configs": [
                        {"job_name": "mirrord", **(scrape_config or {}), "static_configs": [{"targets": targets}]}
                    ],
                },
                indent=2,
            )
        )
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_for(self._ready, 60, "Prometheus /-/ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.log_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}{query}", timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) for each series in the result vector."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def wait_query(self, expr: str, timeout: float = 30) -> list[tuple[dict[str, str], float]]:
        """Poll until the (filtering) expression returns at least one series."""
        return wait_for(lambda: self.query(expr), timeout, f"Prometheus query {expr!r}", interval=0.25)  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[DaemonProcess], PrometheusServer]]:
    """start(daemon) -> a Prometheus scraping that daemon's metrics port; every one stopped at teardown."""
    started: list[PrometheusServer] = []

    def start(daemon: DaemonProcess) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus-{len(started)}", [f"127.0.0.1:{daemon.port}"])
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
        assert server.proc.returncode is not None


def mirrored(mirror: Path, rel: str) -> bool:
    return rel in Manifest.load(mirror).entries and (mirror / rel).exists()


def mirrord_lines(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith("mirrord_")]


def test_prometheus_scrapes_a_mirrored_copy(tmp_path, daemon_factory, prometheus) -> None:
    """A checkpoint is mirrored; Prometheus' API shows the ok copy, the target up and the mirror's space."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory().start()
    prom = prometheus(d)
    assert d.http("/healthz") == (200, "ok\n")
    assert d.http("/readyz") == (200, "ready\n")

    src = publish_checkpoint(primary / "run1" / "step_0010.pt", 10, megabytes=2)
    wait_for(lambda: mirrored(mirror, "run1/step_0010.pt"), 90, "step 10 mirrored")

    [(labels, ok)] = prom.wait_query('mirrord_copies_total{result="ok"} >= 1')
    assert labels["job"] == "mirrord" and ok == 1
    [(labels, _)] = prom.wait_query('up{job="mirrord"} == 1')
    assert labels["instance"] == f"127.0.0.1:{d.port}"
    [(_, free)] = prom.wait_query('mirrord_volume_free_bytes{volume="mirror"} > 0')
    [(_, total)] = prom.wait_query('mirrord_volume_total_bytes{volume="mirror"} > 0')
    assert free <= total
    prom.wait_query(f"mirrord_copied_bytes_total == {src.stat().st_size}")
    prom.wait_query('mirrord_last_mirrored_step{run="run1"} == 10')
    prom.wait_query("mirrord_copy_duration_seconds_count == 1")
    prom.wait_query('mirrord_copies_total{result!="ok"} == 0')
    prom.wait_query('mirrord_build_info{version!=""} == 1')
    prom.wait_query("mirrord_mirror_lag_seconds == 0")
    [(labels, _)] = prom.wait_query("mirrord_watch_mode == 1")
    assert labels["mode"] in ("native", "polling")

    code, body = d.http("/metrics")
    assert code == 200
    print("\n".join(mirrord_lines(body)))  # the scrape of a short run, shown with pytest -s
    assert d.stop() == 0


def test_shipped_alert_rules_evaluate_cleanly_against_real_series(daemon_factory, prometheus) -> None:
    """Prometheus loads config/prometheus/alerts.yml, evaluates every rule without error, nothing fires."""
    d = daemon_factory().start()
    prom = prometheus(d)
    prom.wait_query('up{job="mirrord"} == 1')

    def evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001-") for r in rules)
        return rules if rules and done else None

    rules = wait_for(evaluated, 90, "every alert rule evaluated once", interval=0.25)
    assert {r["name"] for r in rules} >= {"MirrordDown", "MirrordMirrorLagging", "MirrordVerifyFailed"}
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    assert [r["name"] for r in rules if r["state"] == "firing"] == []
    assert d.stop() == 0


def test_paused_runs_and_unconfirmed_copies_reach_prometheus(tmp_path, daemon_factory, prometheus) -> None:
    """Issue 42 case 5: run1's step 1 copy, retired by step 2, had its mtime set to 0 on the mirror; run2's
    primary was wiped. Prometheus sees the unconfirmed copy (held_files{reason="unconfirmed"}, and
    prune_skipped_total{reason="zero_mtime"} again) and the paused run (runs_paused, held_files{paused}).
    Before: `status` listed them, no metric did."""
    from tests.integration.test_daemon_retention import mirror_everything

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for run, step in (("run1", 1), ("run1", 2), ("run2", 1), ("run2", 2)):
        publish_checkpoint(primary / run / f"step_{step:04d}.pt", step)
    mirror_everything(primary, mirror)
    os.utime(mirror / "run1" / "step_0001.pt", (0, 0))
    shutil.rmtree(primary / "run2")
    d = daemon_factory({"prune": {"enabled": True, "keep_last": 1, "min_age_seconds": 0}}).start()
    prom = prometheus(d)
    prom.wait_query('mirrord_prune_skipped_total{reason="zero_mtime"} >= 1')
    prom.wait_query('mirrord_retention_held_files{reason="unconfirmed"} == 1')
    prom.wait_query('mirrord_retention_held_files{reason="paused"} == 1')  # run2's step 1: step 2 is its newest
    prom.wait_query("mirrord_runs_paused == 1")
    assert (mirror / "run1" / "step_0001.pt").exists() and (mirror / "run2" / "step_0001.pt").exists()
    assert d.stop() == 0


def test_lag_is_positive_while_a_copy_waits_and_zero_once_caught_up(
    tmp_path, gated_primary, daemon_factory, prometheus
) -> None:
    """One worker, copies held at a gate: the second checkpoint waits behind the first, so lag > 0; then 0."""
    primary, mirror = gated_primary.backing, tmp_path / "mirror"
    d = daemon_factory({"copy": {"workers": 1}, "watch": {"mode": "polling", "poll_interval_seconds": 0.2}}).start()
    prom = prometheus(d)
    prom.wait_query('up{job="mirrord"} == 1 and on() mirrord_mirror_lag_seconds == 0')
    names = [f"step_{step:04d}.pt" for step in (1, 2)]
    gated_primary.stall(*names)
    for step, name in enumerate(names, start=1):
        publish_checkpoint(primary / "slow" / name, step, megabytes=8)

    def waiting_with_lag() -> bool:
        code, body = d.http("/metrics")  # one scrape, so depth and lag are from the same heartbeat
        values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in mirrord_lines(body)}
        return code == 200 and values["mirrord_queue_depth"] >= 1 and values["mirrord_mirror_lag_seconds"] > 0

    wait_for(waiting_with_lag, 90, "a queued copy with lag > 0 in one scrape")
    prom.wait_query("mirrord_mirror_lag_seconds > 0 and on() mirrord_queue_depth >= 1")  # scraped while held
    gated_primary.unstall()
    wait_for(lambda: all(mirrored(mirror, f"slow/step_{s:04d}.pt") for s in (1, 2)), 60, "both mirrored")
    # Prometheus saw the lag while it lasted, and sees it return to 0 with an empty queue.
    prom.wait_query("max_over_time(mirrord_mirror_lag_seconds[5m]) > 0")
    prom.wait_query("max_over_time(mirrord_queue_depth[5m]) >= 1")
    prom.wait_query("mirrord_mirror_lag_seconds == 0 and mirrord_queue_depth == 0")
    assert d.metric("mirrord_mirror_lag_seconds") == 0
    assert d.metric("mirrord_copies_total", 'result="ok"') == 2
    assert d.stop() == 0


def test_readyz_refuses_an_emptied_mirror_with_the_reason(tmp_path, daemon_factory, prometheus) -> None:
    """Restarted on a mirror whose files vanished (manifest still listing them): alive, not ready, says why."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "run1" / "step_0001.pt", 1)
    first = daemon_factory().start()
    wait_for(lambda: mirrored(mirror, "run1/step_0001.pt"), 90, "step 1 mirrored")
    assert first.stop() == 0

    shutil.rmtree(mirror / "run1")  # what an unmounted volume looks like: the manifest, no files
    assert Manifest.load(mirror).entries
    again = daemon_factory().start(wait_ready=False)
    prom = prometheus(again)

    def refused() -> str | None:
        code, body = again.http("/readyz")
        return body if code == 503 and "manifest" in body else None

    reason = wait_for(refused, 90, "/readyz 503 naming the manifest")
    assert "empty" in reason and "manifest lists 1 file" in reason
    assert again.http("/healthz") == (200, "ok\n"), "refusing to mirror is not being dead"
    again.wait_event("mirror.refused")
    prom.wait_query('up{job="mirrord"} == 1')
    prom.wait_query('mirrord_copies_total{result="ok"} == 0')
    assert not (mirror / "run1").exists(), "nothing may be copied onto a mirror that looks unmounted"
    assert again.stop() == 0
