"""The object-store manifest against a real S3 server: one object per top-level folder (a change writes
only its folder's entries), an older mirrord's single object still loads and is moved into shards on the
first write, and `latest` trusts a recorded object by its ETag, size and LastModified without reading it
(issue 31's per-run manifest; issue 33, case 21)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mirrord.commands.status import collect
from mirrord.commands.sync import run_sync
from mirrord.config import load_config
from mirrord.core.model import ManifestEntry
from mirrord.store.manifest import MANIFEST_NAME, encode_snapshot
from mirrord.store.resume import latest_key
from mirrord.store.s3 import S3Mirror, S3Settings
from mirrord.store.s3 import mirror as s3_mirror
from tests.s3.seaweed import SeaweedServer
from tests.support.checkpoints import save_checkpoint
from tests.support.ports import free_ports

RUNS, PER_RUN = 10, 100


def _entry(path: str, step: int) -> ManifestEntry:
    return ManifestEntry(path, 1000 + step, "blake3", f"{step:064x}", 1, step, 1.0)


def _manifest_put_bytes(mirror: S3Mirror, prefix: str) -> list[int]:
    """Bytes of every PutObject of a manifest object (any layout) this mirror's client sends from now on."""
    sent: list[int] = []

    def count(params: dict[str, Any], **_: Any) -> None:
        if params.get("Key", "").startswith(f"{prefix}/.mirrord-manifest"):
            sent.append(len(params["Body"]))

    mirror.client.meta.events.register("before-parameter-build.s3.PutObject", count)
    return sent


def test_recording_one_copy_writes_only_its_runs_entries(seaweed: SeaweedServer, bucket: str, prefix: str) -> None:
    """10 runs of 100 entries: recording one more entry in one run sends that run's entries, not all
    1,000 (a tenth of the whole manifest, give or take one run's share)."""
    mirror = S3Mirror(f"s3://{bucket}/{prefix}", S3Settings(endpoint_url=seaweed.endpoint))
    manifest = mirror.read_manifest()
    for run in range(RUNS):
        manifest.apply(puts=[_entry(f"run{run}/step_{step}.pt", step) for step in range(PER_RUN)])
    whole = len(encode_snapshot(manifest.entries))
    sent = _manifest_put_bytes(mirror, prefix)
    manifest.record(_entry("run3/step_1000.pt", 1000))
    assert len(sent) == 1
    assert sent[0] < whole / 5, (sent, whole)
    assert len(mirror.load_manifest().entries) == RUNS * PER_RUN + 1


def test_a_manifest_written_by_the_single_object_layout_loads_and_moves_on_first_write(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str
) -> None:
    """An older mirrord's `.mirrord-manifest.json` is read as it is; the first change moves its entries
    into the per-folder objects and deletes it, and nothing recorded is lost."""
    old = {rel: _entry(rel, step) for step, rel in enumerate(["a/step_1.pt", "a/step_2.pt", "b/step_1.pt", "top.pt"])}
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}", Body=encode_snapshot(old))
    mirror = S3Mirror(f"s3://{bucket}/{prefix}", S3Settings(endpoint_url=seaweed.endpoint))
    assert mirror.load_manifest().entries == old

    manifest = mirror.read_manifest()
    manifest.remove("a/step_1.pt")
    expected = {rel: e for rel, e in old.items() if rel != "a/step_1.pt"}
    assert mirror.load_manifest().entries == expected
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/.mirrord-manifest")["Contents"]
    keys = {o["Key"] for o in listed}
    assert f"{prefix}/{MANIFEST_NAME}" not in keys
    assert len(keys) == 3  # a, b and the root's files


def test_latest_trusts_a_recorded_object_by_its_etag_without_reading_it(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """After a sync, `latest` answers from the manifest and the objects' listing alone: no byte of a
    checkpoint is downloaded. An object rewritten with other bytes of the same size (another ETag) is
    not trusted: it is read, found other than recorded, and the step before it is the answer."""
    primary = tmp_path / "primary"
    for step in (1, 2):
        save_checkpoint(primary / f"run/step_{step}.pt", step)
    url = f"s3://{bucket}/{prefix}"
    config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": url,
            "prune": {"enabled": False},
            "copy": {"settle_seconds": 0.0},
            "s3": {"endpoint_url": seaweed.endpoint, "addressing_style": "path", "lease_seconds": 30},
        },
    )
    assert run_sync(config).ok
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    read: list[str] = []
    mirror.client.meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: read.append(params["Key"])
    )
    assert latest_key(mirror, "run") == "run/step_2.pt"
    assert [key for key in read if key.endswith(".pt")] == []

    size = (primary / "run/step_2.pt").stat().st_size
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/run/step_2.pt", Body=b"x" * size)
    assert latest_key(mirror, "run") == "run/step_1.pt"
    assert f"{prefix}/run/step_2.pt" in read


def test_status_trusts_the_newest_checkpoint_by_its_etag_without_reading_it(
    seaweed: SeaweedServer,
    bucket: str,
    prefix: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`status` vouches for each run's newest checkpoint from the manifest and the object's identity:
    no byte of it is downloaded while its ETag, size and LastModified are the recorded ones."""
    primary = tmp_path / "primary"
    save_checkpoint(primary / "run/step_1.pt", 1)
    config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": f"s3://{bucket}/{prefix}",
            "prune": {"enabled": False},
            "copy": {"settle_seconds": 0.0},
            "metrics": {"address": f"127.0.0.1:{free_ports(1)[0]}"},
            "s3": {"endpoint_url": seaweed.endpoint, "addressing_style": "path", "lease_seconds": 30},
        },
    )
    assert run_sync(config).ok
    read: list[str] = []
    made = s3_mirror.make_client

    def counted_client(*args: Any, **kwargs: Any) -> Any:
        client = made(*args, **kwargs)
        client.meta.events.register(
            "before-parameter-build.s3.GetObject", lambda params, **_: read.append(params["Key"])
        )
        return client

    monkeypatch.setattr(s3_mirror, "make_client", counted_client)
    status = collect(config, timeout=2)
    run = next(r for r in status.runs if r.run == "run")
    assert run.verified, run.verify_detail
    assert [key for key in read if key.endswith(".pt")] == []
