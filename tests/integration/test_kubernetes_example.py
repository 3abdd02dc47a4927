"""The Kubernetes example is valid Kubernetes and wires mirrord as the image and README say.

kubernetes-validate (PyPI, ships the API schemas offline) checks every document of sidecar.yaml
strictly (unknown fields rejected) against the first release with native sidecars in the
schemas' stable shape (1.29) and the newest one it knows. The PodMonitor is a Prometheus
Operator custom resource with no schema there; it is checked against the pod it selects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SIDECAR = REPO / "config" / "kubernetes" / "sidecar.yaml"
PODMONITOR = REPO / "config" / "kubernetes" / "podmonitor.yaml"
METRICS_PORT = 9108  # the image's EXPOSE and MIRRORD_METRICS__ADDRESS=0.0.0.0:9108
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pod() -> dict[str, Any]:
    (pod,) = [doc for doc in _documents(SIDECAR) if doc["kind"] == "Pod"]
    return pod


def _mirrord() -> dict[str, Any]:
    (container,) = [c for c in _pod()["spec"]["initContainers"] if c["name"] == "mirrord"]
    return dict(container)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_validates_strictly(version: str) -> None:
    """No unknown field, no wrong type, nothing missing, in any document of the file."""
    documents = _documents(SIDECAR)
    assert {doc["kind"] for doc in documents} == {"Pod", "PersistentVolumeClaim"}
    for doc in documents:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_has_teeth() -> None:
    """1.27 had no restartPolicy on init containers: the same pod is rejected there."""
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(_pod(), "1.27.0", strict=True)


def test_mirrord_is_a_native_sidecar_with_probes_on_its_endpoints() -> None:
    """In initContainers with restartPolicy Always; liveness on /healthz, readiness on /readyz, at the
    port the image serves metrics on; a grace period longer than mirrord's own 30 s."""
    mirrord = _mirrord()
    assert mirrord["restartPolicy"] == "Always"
    (port,) = mirrord["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", METRICS_PORT)
    assert mirrord["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert mirrord["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert mirrord["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert _pod()["spec"]["terminationGracePeriodSeconds"] > 30


def test_the_pod_runs_once_and_its_grace_covers_a_copy_at_the_recommended_rate() -> None:
    """restartPolicy Never (a restart would begin from an empty primary); mirrord's stop grace covers a 10 GiB
    copy at its bandwidth cap, and the pod's grace covers mirrord's."""
    pod = _pod()
    assert pod["spec"]["restartPolicy"] == "Never"
    env = {e["name"]: e["value"] for e in _mirrord()["env"]}
    rate, grace = int(env["MIRRORD_IO__BANDWIDTH_LIMIT"]), float(env["MIRRORD_DAEMON__SHUTDOWN_GRACE_SECONDS"])
    assert grace >= 10 * 2**30 / rate
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace


def test_mirrord_runs_unprivileged_on_a_read_only_root() -> None:
    """runAsNonRoot as the image's uid 10001, read-only root filesystem, no capabilities, no escalation."""
    context = _mirrord()["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (10001, 10001)
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}


def test_the_trainer_writes_what_mirrord_reads_read_only() -> None:
    """The trainer's checkpoint volume is mirrord's /primary, read-only; /mirror is a claim that outlives the pod."""
    pod = _pod()
    (trainer,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mirrord_mounts = {m["mountPath"]: m for m in _mirrord()["volumeMounts"]}
    (written,) = [m["name"] for m in trainer["volumeMounts"]]
    assert mirrord_mounts["/primary"] == {"name": written, "mountPath": "/primary", "readOnly": True}
    mirror = volumes[mirrord_mounts["/mirror"]["name"]]
    claims = [d["metadata"]["name"] for d in _documents(SIDECAR) if d["kind"] == "PersistentVolumeClaim"]
    assert mirror["persistentVolumeClaim"]["claimName"] in claims


def test_prometheus_finds_the_metrics() -> None:
    """The scrape annotations and the PodMonitor both point at the pod's metrics port and /metrics."""
    pod = _pod()
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(METRICS_PORT), "/metrics")
    (monitor,) = _documents(PODMONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels.items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
