"""What a sync asks of the server, counted on the wire (botocore's before-parameter-build event) against a real S3
server: every request costs client CPU and server CPU on a busy machine, so none may creep back in."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

from mirrord.commands.sync import run_sync
from mirrord.config import load_config
from mirrord.store.s3 import mirror as s3
from mirrord.store.s3.manifest import MANIFEST_DIR
from tests.s3.seaweed import SeaweedServer
from tests.support.checkpoints import save_checkpoint


def test_a_small_file_costs_one_put_and_one_head(
    seaweed: SeaweedServer,
    bucket: str,
    prefix: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One PutObject (the commit point) and one HeadObject (its LastModified, which S3 does not answer
    with the PUT) per file; the manifest is written by a few conditional PUTs, never one per object stat."""
    per_key: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def count(model: Any, params: dict[str, Any], **_: Any) -> None:
        per_key[params.get("Key", "")][model.name] += 1

    made = s3.make_client

    def counted_client(*args: Any, **kwargs: Any) -> Any:
        client = made(*args, **kwargs)
        client.meta.events.register("before-parameter-build.s3", count)
        return client

    monkeypatch.setattr(s3, "make_client", counted_client)
    primary = tmp_path / "primary"
    files = [f"run{i % 2}/step_{i}.pt" for i in range(6)]
    for step, rel in enumerate(files):
        save_checkpoint(primary / rel, step)
    config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": f"s3://{bucket}/{prefix}",
            "prune": {"enabled": False},
            "copy": {"settle_seconds": 0.0},
            "s3": {"endpoint_url": seaweed.endpoint, "addressing_style": "path", "lease_seconds": 30},
        },
    )
    assert run_sync(config).ok
    for rel in files:
        assert per_key[f"{prefix}/{rel}"] == {"PutObject": 1, "HeadObject": 1}, rel
    for shard in ("run0", "run1"):  # one manifest object per top-level folder
        manifest = per_key.pop(f"{prefix}/{MANIFEST_DIR}/folders/{shard}.json")
        assert 1 <= manifest["PutObject"] <= len(files) and set(manifest) <= {"GetObject", "PutObject"}
    data_keys = {f"{prefix}/{rel}" for rel in files}
    others = {key: ops for key, ops in per_key.items() if key not in data_keys}
    assert all(key.startswith(f"{prefix}/.mirrord-") or key == "" for key in others), others  # leases, listings
