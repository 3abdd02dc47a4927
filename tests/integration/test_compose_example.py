"""The docker-compose example wires trainer, mirrord and Prometheus together consistently.

No Docker engine or Compose is available where these tests run, so the file is checked
structurally: the volumes are shared the way the README promises (primary read-only for
mirrord), every file it mounts exists, and its inline Prometheus config passes `promtool check
config` with the shipped alert rules and scrapes mirrord where the image serves metrics.
"""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.cli import child_env, run_mirrord

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "config" / "docker-compose.example.yml"


def _compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _mounts(service: str) -> dict[str, str]:
    """Container path -> "source[:mode]" for a service's short-syntax volumes."""
    mounts = {}
    for spec in _compose()["services"][service]["volumes"]:
        source, target, *mode = spec.split(":")
        mounts[target] = ":".join([source, *mode])
    return mounts


def test_trainer_writes_the_volume_mirrord_reads_read_only() -> None:
    """The trainer's checkpoint volume is mirrord's /primary, mounted read-only."""
    trainer = _mounts("trainer")
    (shared,) = [source for source in trainer.values() if ":" not in source]
    mirrord = _mounts("mirrord")
    assert mirrord["/primary"] == f"{shared}:ro"
    assert mirrord["/mirror"] == "mirror"
    assert set(_compose()["volumes"]) == {shared, "mirror"}


def test_mirrord_is_built_from_the_repository_and_given_time_to_stop() -> None:
    """The build context is the repo root and the stop grace outlasts the daemon's 30 s."""
    service = _compose()["services"]["mirrord"]
    context = (COMPOSE.parent / service["build"]["context"]).resolve()
    assert context == REPO
    assert (context / service["build"]["dockerfile"]).is_file()
    grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
    assert grace and int(grace.group(1)) > 30


def test_every_mounted_host_file_exists() -> None:
    """Bind-mounted files are repo files, relative to the compose file."""
    for service in ("mirrord", "prometheus"):
        for source in _mounts(service).values():
            path = source.split(":")[0]
            if path.startswith("."):
                assert (COMPOSE.parent / path).is_file(), f"{service}: {path}"


def test_inline_prometheus_config_is_valid_and_scrapes_mirrord(tmp_path: Path) -> None:
    """promtool accepts the inline config with the mounted rules; the target is mirrord:9108."""
    compose = _compose()
    prometheus = compose["services"]["prometheus"]
    (config_ref,) = prometheus["configs"]
    content = compose["configs"][config_ref["source"]]["content"]
    scrape = yaml.safe_load(content)
    assert scrape["scrape_configs"] == [{"job_name": "mirrord", "static_configs": [{"targets": ["mirrord:9108"]}]}]

    config_dir = posixpath.dirname(config_ref["target"])
    rules_mounts = {
        target: source.split(":")[0]
        for target, source in _mounts("prometheus").items()
        if posixpath.dirname(target) == config_dir
    }
    (tmp_path / posixpath.basename(config_ref["target"])).write_text(content)
    for target, source in rules_mounts.items():
        shutil.copy2(COMPOSE.parent / source, tmp_path / posixpath.basename(target))
    for rule_file in scrape["rule_files"]:
        assert (tmp_path / rule_file).is_file(), f"{rule_file} is not mounted next to the config"

    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install prometheus (done by .ci/run)"
    result = subprocess.run(
        [promtool, "check", "config", posixpath.basename(config_ref["target"])],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rules found" in result.stdout


def test_the_stand_in_trainer_runs_and_its_checkpoints_mirror(tmp_path: Path) -> None:
    """The example's trainer is no placeholder image: its own entrypoint (run here with a short run's
    variables) commits checkpoints that `mirrord sync` mirrors as whole ones (issue 45.8)."""
    trainer = _compose()["services"]["trainer"]
    assert trainer["build"] == _compose()["services"]["mirrord"]["build"]
    program, flag, code = trainer["entrypoint"]
    env = child_env({"CHECKPOINTS": str(tmp_path / "primary"), "STEPS": "2", "INTERVAL": "0"})
    subprocess.run([sys.executable if program == "python" else program, flag, code], env=env, check=True, timeout=120)
    synced = run_mirrord("sync", "--primary", tmp_path / "primary", "--mirror", tmp_path / "mirror")
    assert synced.returncode == 0, synced.stderr
    assert sorted(p.name for p in (tmp_path / "mirror" / "run").iterdir()) == ["step_000001.pt", "step_000002.pt"]
