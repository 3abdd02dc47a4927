"""`run`, `sync`, `prune` and `status` decide through one reconcile, so a mirror that looks unmounted is
refused by all four with the same words (before, `sync` copied into it and exited 0)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mirrord.store.manifest import Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.cli import run_mirrord
from tests.support.logs import parse_events
from tests.support.wait import wait_for

CAUSE = "the mirror is empty but its manifest lists 1 file(s): is it mounted?"


def test_sync_refuses_an_unmounted_looking_mirror_exactly_like_run(tmp_path: Path, daemon_factory) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    daemon = daemon_factory()
    config = ("--config", daemon.config_path)
    first = run_mirrord("sync", "--json", *config)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["refused"] is None
    shutil.rmtree(mirror / "r")  # what an unmounted mirror volume looks like: its mount point, empty
    publish_checkpoint(primary / "r" / "step_0002.pt", 2)

    refused = run_mirrord("sync", "--json", *config)
    assert refused.returncode == 1
    doc = json.loads(refused.stdout)
    assert (doc["ok"], doc["copied"], doc["refused"]) == (False, [], CAUSE)
    assert f"REFUSED: {CAUSE}; nothing copied" in refused.stderr
    assert [e["cause"] for e in parse_events(refused.stderr, "mirror.refused")] == [CAUSE]
    assert not (mirror / "r").exists() and list(Manifest.load(mirror).entries) == ["r/step_0001.pt"]

    daemon.start(wait_ready=False)
    # (503 "first reconcile not finished" comes first: wait for the refusal itself.)
    wait_for(lambda: daemon.http("/readyz") == (503, CAUSE + "\n"), 90, "the daemon refuses the mirror")
    assert daemon.wait_event("mirror.refused", check="listing")["cause"] == CAUSE

    pruned = run_mirrord("prune", "--dry-run", *config)
    assert pruned.returncode == 1 and f"REFUSED (mirror_unmounted): {CAUSE}" in pruned.stdout
    status = run_mirrord("status", "--json", *config)
    assert status.returncode == 1
    assert any(p.startswith("mirror:") and p.endswith(CAUSE) for p in json.loads(status.stdout)["problems"])

    assert daemon.stop() == 0
    assert not (mirror / "r").exists()  # neither sync nor run copied into the empty mount point
