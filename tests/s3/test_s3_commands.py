"""`mirror = "s3://bucket/prefix"` end to end: the real CLI and daemon against a real S3 server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tomli_w

from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.support.checkpoints import save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.logs import parse_events
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

MIB = 1 << 20


def _settings(seaweed: SeaweedServer, **extra: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "endpoint_url": seaweed.endpoint,
        "addressing_style": "path",
        "part_size": 5 * MIB,
        "concurrency": 4,
        "lease_seconds": 30,
    }
    settings.update(extra)
    return settings


def _config(
    path: Path, primary: Path, url: str, seaweed: SeaweedServer, layout_: str = "torch", **sections: Any
) -> Path:
    data: dict[str, Any] = {
        "primary": str(primary),
        "mirror": url,
        "s3": _settings(seaweed),
        "copy": {"settle_seconds": 0.0, "retry_backoff_seconds": 0.1},
        "log": {"format": "json"},
        "layout": layout_,
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path.write_text(tomli_w.dumps(data))
    return path


def _tree(primary: Path) -> dict[str, Path]:
    files = {}
    for run in ("runA", "runB"):
        for step in (1, 2, 3):
            rel = f"{run}/step_{step}.pt"
            files[rel] = save_checkpoint(primary / rel, step)
    files["runA/step_4.pt"] = save_checkpoint(primary / "runA/step_4.pt", 4, width=800)  # ~15 MB: multipart
    return files


def test_sync_mirrors_a_tree_then_prune_keeps_the_newest(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    primary = tmp_path / "primary"
    files = _tree(primary)
    url = f"s3://{bucket}/{prefix}"
    config = _config(
        tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": True, "keep_last": 2, "min_age_seconds": 0}
    )
    done = run_mirrord("sync", "--config", config, env=s3_env, timeout=300)
    assert done.returncode == 0, done.stderr
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    manifest = mirror.load_manifest().entries
    listed = mirror.snapshot(["*.pt"]).files
    # keep_last = 2 per run: sync copies only what retention keeps
    kept = {"runA/step_3.pt", "runA/step_4.pt", "runB/step_2.pt", "runB/step_3.pt"}
    assert set(listed) == kept == set(manifest)
    for rel in kept:
        assert manifest[rel].digest == hash_file(files[rel], manifest[rel].algo)
        with mirror.open_read(rel) as fh:
            assert fh.read() == files[rel].read_bytes()
    assert listed["runA/step_4.pt"].size > 2 * 5 * MIB
    assert mirror.stale_uploads(older_than=0) == []

    # A new step: sync copies it, prune (guards from LastModified, min_age 0) retires the oldest kept.
    files["runB/step_5.pt"] = save_checkpoint(primary / "runB/step_5.pt", 5)
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    pruned = run_mirrord("prune", "--config", config, env=s3_env, timeout=300)
    assert pruned.returncode == 0, pruned.stderr
    assert set(mirror.snapshot(["*.pt"]).files) == kept - {"runB/step_2.pt"} | {"runB/step_5.pt"}
    assert set(mirror.load_manifest().entries) == kept - {"runB/step_2.pt"} | {"runB/step_5.pt"}


def test_prune_guards_keep_recent_objects(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    primary = tmp_path / "primary"
    for step in (1, 2, 3):
        save_checkpoint(primary / f"run/step_{step}.pt", step)
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    # Retention on, keep 1, but every object was written seconds ago (LastModified): the age guard keeps all.
    config = _config(
        tmp_path / "mirrord.toml",
        primary,
        url,
        seaweed,
        prune={"enabled": True, "keep_last": 1, "min_age_seconds": 3600},
    )
    done = run_mirrord("prune", "--config", config, env=s3_env, timeout=300)
    assert done.returncode == 0, done.stderr
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    assert set(mirror.snapshot(["*.pt"]).files) == {f"run/step_{s}.pt" for s in (1, 2, 3)}
    skipped = [e for e in parse_events(done.stderr) if e.get("event") == "prune.finished"]
    assert skipped and skipped[0]["deleted"] == 0


def test_daemon_mirrors_into_s3_and_two_nodes_share_a_prefix(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    url = f"s3://{bucket}/{prefix}"
    daemons = []
    try:
        for node in ("node-1", "node-2"):
            primary = tmp_path / node / "primary"
            primary.mkdir(parents=True)
            daemon = DaemonProcess(
                tmp_path / node,
                primary,
                Path("/unused"),
                env=s3_env,
                settings={"mirror": url, "s3": _settings(seaweed, node=node)},
            )
            daemon.settings["mirror"] = url
            daemon.write_config()
            daemons.append((node, primary, daemon.start()))
        for node, primary, _daemon in daemons:
            for step in (1, 2):
                save_checkpoint(primary / f"{node}/step_{step}.pt", step)
        mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
        wanted = {f"{node}/step_{s}.pt" for node, _, _ in daemons for s in (1, 2)}
        wait_for(lambda: set(mirror.load_manifest().entries) == wanted, 180, "both nodes' checkpoints recorded")
        assert set(mirror.snapshot(["*.pt"]).files) == wanted
        for _node, _primary, daemon in daemons:
            assert daemon.metric("mirrord_volume_free_bytes", 'volume="primary"') is not None
            assert daemon.metric("mirrord_volume_free_bytes", 'volume="mirror"') is None  # absent, not 0
        # a second daemon under an existing node name is refused (the lease)
        node, primary, _ = daemons[0]
        (tmp_path / "twin").mkdir()
        twin = DaemonProcess(
            tmp_path / "twin",
            primary,
            Path("/unused"),
            env=s3_env,
            settings={"mirror": url, "s3": _settings(seaweed, node=node)},
        )
        twin.settings["mirror"] = url
        twin.write_config()
        twin.start(wait_ready=False)
        assert twin.proc is not None and twin.proc.wait(120) != 0
        twin.stop()
        assert "lease" in twin.log_text()
    finally:
        for _node, _primary, daemon in daemons:
            daemon.stop()
    assert os.environ["AWS_ACCESS_KEY_ID"]


def test_verify_latest_and_status_read_the_bucket(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    primary = tmp_path / "primary"
    files = _tree(primary)
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    verified = run_mirrord("verify", "--config", config, env=s3_env, timeout=300)
    assert verified.returncode == 0, verified.stderr
    assert f"verified {len(files)} file(s): {len(files)} intact" in verified.stdout
    deep = run_mirrord("verify", "--deep", "--config", config, env=s3_env, timeout=300)
    assert deep.returncode == 0, deep.stderr
    latest = run_mirrord("latest", "--run", "runA", "--verify", "--config", config, env=s3_env)
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip() == f"{url}/runA/step_4.pt"

    # The newest object damaged behind mirrord's back: verify names it, latest falls back to the step before.
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    damaged = bytearray(files["runA/step_4.pt"].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/runA/step_4.pt", Body=bytes(damaged))
    verified = run_mirrord("verify", "--config", config, env=s3_env, timeout=300)
    assert verified.returncode == 1
    assert "runA/step_4.pt" in verified.stdout
    latest = run_mirrord("latest", "--run", "runA", "--verify", "--config", config, env=s3_env)
    assert latest.stdout.strip() == f"{url}/runA/step_3.pt", latest.stderr

    status = run_mirrord("status", "--json", "--config", config, env=s3_env, timeout=300)
    assert status.returncode in (0, 1), status.stderr
    assert url in status.stdout


def test_two_nodes_one_prefix_only_the_retention_holder_prunes_from_the_merged_manifest(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Two daemons on two primaries write the ranks of the same steps into one run. Each step on the
    mirror is made of both nodes' files: only the node holding the prefix's retention lease prunes the
    mirror, and only once the merged manifest (both nodes' entries) shows the newer step whole. When it
    stops, the other node takes retention over."""
    url = f"s3://{bucket}/{prefix}"
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    nodes: dict[str, tuple[Path, DaemonProcess]] = {}
    for node in ("node-1", "node-2"):
        primary = tmp_path / node / "primary"
        primary.mkdir(parents=True)
        daemon = DaemonProcess(
            tmp_path / node,
            primary,
            Path("/unused"),
            env=s3_env,
            settings={
                "mirror": url,
                "s3": _settings(seaweed, node=node, lease_seconds=10),
                "prune": {"enabled": True, "keep_last": 1, "min_age_seconds": 0},
                "watch": {"rescan_interval_seconds": 2},
            },
        )
        daemon.settings["mirror"] = url
        daemon.write_config()
        nodes[node] = (primary, daemon)

    def files(step: int, ranks: tuple[int, ...] = (0, 1)) -> set[str]:
        return {f"run/step_{step}_rank{r}.pt" for r in ranks}

    def write(step: int, only: tuple[str, ...] = ("node-1", "node-2")) -> None:
        for rank, (node, (primary, _daemon)) in enumerate(nodes.items()):
            if node in only:
                save_checkpoint(primary / f"run/step_{step}_rank{rank}.pt", step)

    def mirrored() -> set[str]:
        return set(mirror.snapshot(["*.pt"]).files)

    try:
        for _primary, daemon in nodes.values():
            daemon.start()
        write(1)
        wait_for(lambda: set(mirror.load_manifest().entries) == files(1), 180, "step 1 of both ranks recorded")
        write(2)
        wait_for(
            lambda: mirrored() == files(2) and set(mirror.load_manifest().entries) == files(2),
            240,
            "step 1 pruned once step 2 is whole",
            context=lambda: str(sorted(mirrored())),
        )
        holders = [n for n, (_p, d) in nodes.items() if d.events("s3.retention_claimed")]
        assert len(holders) == 1, holders
        holder = holders[0]
        other = "node-2" if holder == "node-1" else "node-1"
        assert nodes[other][1].events("prune.mirror_elsewhere")
        assert not nodes[other][1].events("prune.deleted", volume="mirror")  # it never deleted a mirror file
        deleted = {e["path"] for e in nodes[holder][1].events("prune.deleted", volume="mirror")}
        assert deleted == files(1)  # both nodes' files of step 1, the other node's too

        # The holder stops (gives its leases back): the other node takes retention over.
        nodes[holder][1].stop()
        write(3, only=(other,))
        wait_for(
            lambda: mirrored() == files(3, (0 if other == "node-1" else 1,)),
            240,
            "step 2 pruned by the node left",
            context=lambda: str(sorted(mirrored())),
        )
        assert nodes[other][1].events("s3.retention_claimed")
        assert set(mirror.load_manifest().entries) == mirrored()
    finally:
        for _primary, daemon in nodes.values():
            daemon.stop()


def test_prune_keeps_the_folder_the_buckets_deepspeed_tag_names(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 33 case 8 on S3, keep_last 1: global_step8 then global_step16 are mirrored, and the bucket's
    `latest` tag still names global_step8 (as between the folder's upload and the tag's, or while another
    node's copy of the tag is behind). Prune keeps global_step8 while the bucket's tag names it; once sync
    has put the trainer's tag up, global_step8 goes. Before: a tag was never read on an object store, and
    global_step8 was deleted while the bucket's tag named it."""
    primary, url = tmp_path / "primary", f"s3://{bucket}/{prefix}"
    tag = primary / "out" / "latest"
    copy_only = _config(tmp_path / "sync.toml", primary, url, seaweed, prune={"enabled": False}, layout_="deepspeed")
    config = _config(
        tmp_path / "mirrord.toml",
        primary,
        url,
        seaweed,
        layout_="deepspeed",
        prune={"enabled": True, "keep_last": 1, "min_age_seconds": 0},
    )
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))

    def folders() -> set[str]:
        return {rel.split("/")[1] for rel in mirror.snapshot(["*.pt"]).files if "/global_step" in rel}

    def tagged() -> bytes:
        with mirror.open_read("out/latest") as stream:
            return stream.read()

    for step in (8, 16):
        folder = primary / "out" / f"global_step{step}"
        save_checkpoint(folder / "mp_rank_00_model_states.pt", step)
        save_checkpoint(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step + 1)
        tag.write_text(f"global_step{step}")
        done = run_mirrord("sync", "--config", copy_only, env=s3_env, timeout=300)
        assert done.returncode == 0 and tagged() == f"global_step{step}".encode(), done.stderr
    assert folders() == {"global_step8", "global_step16"}
    mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/out/latest", Body=b"global_step8")
    held = run_mirrord("prune", "--config", config, env=s3_env, timeout=300)
    assert held.returncode == 0, held.stderr
    assert folders() == {"global_step8", "global_step16"}, held.stdout
    kept = {tuple(line.split()) for line in held.stdout.splitlines()}
    assert ("mirror", "out/global_step8/mp_rank_00_model_states.pt", "pointer") in kept, held.stdout
    done = run_mirrord("sync", "--config", copy_only, env=s3_env, timeout=300)
    assert done.returncode == 0 and tagged() == b"global_step16", done.stderr
    pruned = run_mirrord("prune", "--config", config, env=s3_env, timeout=300)
    assert pruned.returncode == 0, pruned.stderr
    assert folders() == {"global_step16"}, pruned.stdout
