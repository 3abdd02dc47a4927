"""The shipped Prometheus alert rules and scrape config are valid, and every rule provably fires.

promtool comes with Debian's `prometheus` package, which .ci/run installs. The rules' unit
tests live in data/alerts_test.yml: synthetic series in, expected firing alerts (labels and
rendered annotations) out, plus a healthy mirror that must raise nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "config" / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = REPO / "config" / "prometheus" / "prometheus.yml"
RULE_TESTS = Path(__file__).resolve().parent / "data" / "alerts_test.yml"


# The metric names fixed by the observability issue; an alert on any other name never fires.
def _exported_metrics() -> set[str]:
    """Every metric mirrord exports, read from a fresh registry (so a renamed metric fails here).

    Families are collected rather than scraped: a labelled gauge has no sample before it is first set.
    """
    from mirrord.obs.metrics import Metrics

    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


EXPORTED_METRICS = _exported_metrics()


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install prometheus (done by .ci/run)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False)


def _alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), flags=re.MULTILINE)


def test_rules_pass_promtool_check() -> None:
    """promtool parses every rule, its PromQL and its templates, and lints them clean."""
    result = _promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    assert f"SUCCESS: {len(_alert_names())} rules found" in result.stdout


def test_rules_fire_exactly_as_their_unit_tests_expect() -> None:
    """Each alert fires on its scenario, with its labels and annotations, and only then."""
    result = _promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_unit_test() -> None:
    """No rule ships without a scenario in which it is shown to fire."""
    tests = RULE_TESTS.read_text()
    firing = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels:", tests))
    assert set(_alert_names()) == firing


def test_rules_only_use_exported_metric_names() -> None:
    """A typo in a metric name would make an alert silently never fire."""
    used = set(re.findall(r"\bmirrord_[a-z_]+\b", RULES.read_text()))
    assert used
    assert used <= EXPORTED_METRICS, used - EXPORTED_METRICS


def test_example_scrape_config_is_valid_and_loads_the_rules() -> None:
    """The example prometheus.yml is accepted by promtool, rule file included."""
    result = _promtool("check", "config", SCRAPE_CONFIG.name, cwd=SCRAPE_CONFIG.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_names())} rules found" in result.stdout
