"""A DCP checkpoint saved by two ranks on two training nodes, each node's mirrord uploading its share into
one prefix (s3.units_span_nodes): real `mirrord run` processes, a real two-rank dcp.save, a real S3 server."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import tomli_w

from mirrord.layouts import layout_for
from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support.checkpoints import BASE_MTIME_NS, checkpoint_bytes, save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.daemon import READY_SECONDS, DaemonProcess
from tests.support.dcp_ranks import save_two_ranks
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

DCP = layout_for("dcp")
NODES = ("node-1", "node-2")
SHARES = {"node-1": (".metadata", "__0_0.distcp"), "node-2": ("__1_0.distcp",)}  # rank 0 writes .metadata


def _files(step: int) -> set[str]:
    return {f"run/step_{step}/{name}" for share in SHARES.values() for name in share}


def _start(daemon: DaemonProcess) -> None:
    """Start it, again while the lease of its own killed process has not expired yet (it is refused then)."""

    def ready() -> bool:
        if daemon.proc is None or daemon.exited():
            daemon.kill()  # reaps the refused process and closes its log before the next try
            daemon.start(wait_ready=False)
        return daemon.http("/readyz")[0] == 200

    wait_for(
        ready, READY_SECONDS + 60, f"{daemon.workdir.name} ready", interval=1, context=lambda: daemon.log_text()[-3000:]
    )


def test_a_dcp_folder_saved_on_two_nodes_is_complete_only_once_both_shares_are_uploaded(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Nothing of a step is recorded, nor served by `latest`, while one node's share is missing: not when
    the other node uploaded its share, not while the daemon of the missing share is killed with SIGKILL.
    Once both shares are up, the unit is recorded whole with every file's hash, `latest` against the bucket
    names it, and retention (one node, from the merged manifest) deletes the older multi-node step whole."""
    url = f"s3://{bucket}/{prefix}"
    saved = save_two_ranks(tmp_path / "saves", [1, 2])  # real dcp.save by two gloo ranks
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    daemons: dict[str, DaemonProcess] = {}
    primaries: dict[str, Path] = {}
    for node in NODES:
        primaries[node] = tmp_path / node / "primary"
        (primaries[node] / "run").mkdir(parents=True)
        daemon = DaemonProcess(
            tmp_path / node,
            primaries[node],
            Path("/unused"),
            env=s3_env,
            settings={
                "mirror": url,
                "layout": "dcp",
                "s3": _settings(seaweed, node=node, lease_seconds=10, units_span_nodes=True),
                "prune": {"enabled": True, "keep_last": 1, "min_age_seconds": 0},
                "watch": {"rescan_interval_seconds": 2},
            },
        )
        daemon.settings["mirror"] = url
        daemon.write_config()
        daemons[node] = daemon
    node_config = daemons["node-1"].config_path

    def place(node: str, step: int) -> None:
        """The node's share of the step appears on its primary whole (one rename of the folder)."""
        staged = tmp_path / node / f"staged-{step}"
        staged.mkdir()
        for name in SHARES[node]:
            shutil.copy2(saved[step - 1] / name, staged / name)
        staged.rename(primaries[node] / "run" / f"step_{step}")

    def recorded(step: int) -> set[str]:
        return {rel for rel in mirror.load_manifest().entries if rel.startswith(f"run/step_{step}/")}

    def stored(step: int) -> set[str]:
        return {rel for rel in mirror.snapshot([], DCP).files if rel.startswith(f"run/step_{step}/")}

    def latest() -> Any:
        return run_mirrord("latest", "--run", "run", "--config", node_config, env=s3_env, timeout=300)

    def reconciled(node: str) -> int:
        return len(daemons[node].events("reconcile.finished"))

    try:
        for daemon in daemons.values():
            daemon.start()
        # Node 1's share of step 1 (.metadata and rank 0's file): uploaded and recorded as its part only.
        place("node-1", 1)
        part = daemons["node-1"].wait_event("copy.part_recorded", timeout=180, path="run/step_1")
        assert "__1_0.distcp" in part["waiting_for"]
        assert stored(1) == {f"run/step_1/{n}" for n in SHARES["node-1"]}
        assert recorded(1) == set()
        shared = mirror.manifest_store()
        shared.load()
        assert set(shared.contributions()["run/step_1"]) == {"node-1"}
        none = latest()
        assert none.returncode != 0 and none.stdout.strip() == "", none.stdout

        # Node 2's share (rank 1's file, no .metadata): the unit is complete, recorded whole.
        place("node-2", 1)
        wait_for(
            lambda: recorded(1) == _files(1), 180, "step 1 recorded whole", context=lambda: str(sorted(recorded(1)))
        )
        completed = [e for d in daemons.values() for e in d.events("unit.completed", path="run/step_1")]
        assert len(completed) == 1, completed
        entries = mirror.load_manifest().entries
        for rel in _files(1):
            source = saved[0] / rel.rsplit("/", 1)[1]
            assert entries[rel].digest == hash_file(source, entries[rel].algo), rel
            with mirror.open_read(rel) as stream:
                assert stream.read() == source.read_bytes()
        shared.load()
        assert "run/step_1" not in shared.contributions()
        found = latest()
        assert found.returncode == 0, found.stderr
        assert found.stdout.strip() == f"{url}/run/step_1"
        verified = run_mirrord("verify", "--config", node_config, env=s3_env, timeout=300)
        assert verified.returncode == 0, verified.stdout + verified.stderr

        # Step 2: node 1 uploads its share; node 2's daemon is killed before its share exists.
        place("node-1", 2)
        daemons["node-1"].wait_event("copy.part_recorded", timeout=180, path="run/step_2")
        daemons["node-2"].kill()
        place("node-2", 2)
        turns = reconciled("node-1")
        wait_for(lambda: reconciled("node-1") >= turns + 2, 120, "two more full reconciles of node 1")
        assert recorded(2) == set()
        assert recorded(1) == _files(1) and stored(1) == _files(1)  # the newest whole step stays
        assert latest().stdout.strip() == f"{url}/run/step_1"

        # Node 2 back: its share goes up, step 2 is complete, and step 1 (both nodes' files) is deleted whole.
        _start(daemons["node-2"])
        wait_for(lambda: recorded(2) == _files(2), 180, "step 2 recorded whole")
        wait_for(
            lambda: stored(1) == set() and recorded(1) == set(),
            180,
            "step 1 pruned whole",
            context=lambda: str(sorted(stored(1))),
        )
        assert latest().stdout.strip() == f"{url}/run/step_2"
        deleted = {e["path"] for d in daemons.values() for e in d.events("prune.deleted", volume="mirror")}
        assert "run/step_1" in deleted  # the unit, with both nodes' files
        holders = {n for n, d in daemons.items() if d.events("s3.retention_claimed")}
        deleters = {n for n, d in daemons.items() if d.events("prune.deleted", volume="mirror")}
        assert deleters and deleters <= holders
    finally:
        for daemon in daemons.values():
            daemon.kill()


def test_sync_on_each_node_uploads_its_share_and_the_second_completes_the_unit(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """`mirrord sync` on the node without the .metadata first: its share is recorded as a part, nothing is
    served; `sync` on the other node completes the unit, and a second pass on either has nothing to do."""
    url = f"s3://{bucket}/{prefix}"
    saved = save_two_ranks(tmp_path / "saves", [5])[0]
    configs: dict[str, Path] = {}
    for node in reversed(NODES):
        folder = tmp_path / node / "primary" / "run" / "step_5"
        folder.mkdir(parents=True)
        for name in SHARES[node]:
            shutil.copy2(saved / name, folder / name)
        configs[node] = tmp_path / node / "mirrord.toml"
        configs[node].write_text(
            tomli_w.dumps(
                {
                    "primary": str(tmp_path / node / "primary"),
                    "mirror": url,
                    "layout": "dcp",
                    "s3": _settings(seaweed, node=node, units_span_nodes=True),
                    "copy": {"settle_seconds": 0.0, "retry_backoff_seconds": 0.1},
                    "log": {"format": "json"},
                }
            )
        )
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))

    first = run_mirrord("sync", "--config", configs["node-2"], env=s3_env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "copy.part_recorded" in first.stderr
    assert mirror.load_manifest().entries == {}
    assert run_mirrord("latest", "--config", configs["node-2"], env=s3_env).stdout.strip() == ""
    # verify checks the part against what node 2 recorded, and calls it neither intact nor a problem
    verified = run_mirrord("verify", "--config", configs["node-1"], env=s3_env, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "PART" in verified.stdout and "run/step_5/__1_0.distcp" in verified.stdout
    assert "1 file(s) of units waiting for other nodes' shares" in verified.stdout
    status = run_mirrord("status", "--config", configs["node-1"], env=s3_env, timeout=300)
    assert "1 unit(s) waiting for other nodes' shares, e.g. run/step_5 (has node-2's)" in status.stdout, status.stdout
    mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/run/step_5/__1_0.distcp", Body=b"torn")
    damaged = run_mirrord("verify", "--config", configs["node-1"], env=s3_env, timeout=300)
    assert damaged.returncode == 1 and "part uploaded by node node-2, and size_mismatch" in damaged.stdout
    again = run_mirrord("sync", "--config", configs["node-2"], env=s3_env, timeout=300)  # the share goes up again
    assert again.returncode == 0 and "copy.part_recorded" in again.stderr, again.stderr

    second = run_mirrord("sync", "--config", configs["node-1"], env=s3_env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "unit.completed" in second.stderr
    assert set(mirror.load_manifest().entries) == _files(5)
    found = run_mirrord("latest", "--config", configs["node-2"], env=s3_env)
    assert found.stdout.strip() == f"{url}/run/step_5", found.stderr
    for node in NODES:
        again = run_mirrord("sync", "--config", configs[node], env=s3_env, timeout=300)
        assert again.returncode == 0 and "copy.started" not in again.stderr, again.stderr


def _node_configs(tmp_path: Path, url: str, seaweed: SeaweedServer) -> dict[str, Path]:
    """One `mirrord sync` config per node, each with its own primary, both into one prefix."""
    configs = {}
    for node in NODES:
        (tmp_path / node / "primary" / "run").mkdir(parents=True)
        configs[node] = tmp_path / node / "mirrord.toml"
        configs[node].write_text(
            tomli_w.dumps(
                {
                    "primary": str(tmp_path / node / "primary"),
                    "mirror": url,
                    "s3": _settings(seaweed, node=node),
                    "copy": {"settle_seconds": 0.0, "retry_backoff_seconds": 0.1},
                    "log": {"format": "json"},
                }
            )
        )
    return configs


def test_the_same_bytes_saved_on_two_nodes_are_uploaded_once_whatever_their_mtimes(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 33 case 4: every node's rank 0 saves run/step_5.pt with the same bytes at another time. The
    first node's upload is recorded as its entry; the other node hashes its file, finds the same bytes
    and uploads nothing, on every pass (before: each node re-uploaded it in turn, forever)."""
    url = f"s3://{bucket}/{prefix}"
    configs = _node_configs(tmp_path, url, seaweed)
    for offset, node in enumerate(NODES):
        save_checkpoint(tmp_path / node / "primary" / "run" / "step_5.pt", 5, mtime_ns=BASE_MTIME_NS + offset * 10**9)
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    first = run_mirrord("sync", "--config", configs["node-1"], env=s3_env, timeout=300)
    assert first.returncode == 0 and "copy.committed" in first.stderr, first.stderr
    recorded = mirror.load_manifest().entries["run/step_5.pt"]
    etag = mirror.client.head_object(Bucket=bucket, Key=f"{prefix}/run/step_5.pt")["ETag"]
    for _round in range(2):
        for node in (*reversed(NODES), *NODES):
            again = run_mirrord("sync", "--config", configs[node], env=s3_env, timeout=300)
            assert again.returncode == 0, again.stderr
            assert "copy.committed" not in again.stderr, (node, again.stderr)
            if node == "node-2":
                assert "copy.same_as_node" in again.stderr, again.stderr
    assert mirror.load_manifest().entries["run/step_5.pt"] == recorded
    assert recorded.node == "node-1"
    assert mirror.client.head_object(Bucket=bucket, Key=f"{prefix}/run/step_5.pt")["ETag"] == etag


def test_other_bytes_under_the_same_name_on_another_node_are_a_conflict_never_taken_as_mirrored(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 33 case 4: node 2's run/step_5.pt has other bytes than node 1's, with the same size and mtime.
    Node 2 never takes node 1's entry for its own file (before: it called it in sync and never uploaded
    it, silently): it reports a conflict naming both nodes, uploads nothing over node 1's copy, and
    `sync` fails; node 1's copy and entry stay, and node 1 stays in sync (no ping-pong)."""
    url = f"s3://{bucket}/{prefix}"
    configs = _node_configs(tmp_path, url, seaweed)
    mine, theirs = checkpoint_bytes(5, seed=100), checkpoint_bytes(5, seed=101)
    assert len(mine) == len(theirs) and mine != theirs
    for node, data in zip(NODES, (mine, theirs), strict=True):
        path = tmp_path / node / "primary" / "run" / "step_5.pt"
        path.write_bytes(data)
        os.utime(path, ns=(BASE_MTIME_NS, BASE_MTIME_NS))
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    assert run_mirrord("sync", "--config", configs["node-1"], env=s3_env, timeout=300).returncode == 0
    recorded = mirror.load_manifest().entries["run/step_5.pt"]
    for _round in range(2):
        other = run_mirrord("sync", "--config", configs["node-2"], env=s3_env, timeout=300)
        assert other.returncode != 0, other.stderr
        assert "copy.committed" not in other.stderr
        conflicts = [json.loads(line) for line in other.stderr.splitlines() if "copy.node_conflict" in line]
        assert conflicts and conflicts[0]["node"] == "node-2" and conflicts[0]["recorded_by"] == "node-1", other.stderr
        assert conflicts[0]["path"] == "run/step_5.pt"
        same = run_mirrord("sync", "--config", configs["node-1"], env=s3_env, timeout=300)
        assert same.returncode == 0 and "copy.started" not in same.stderr, same.stderr
    assert mirror.load_manifest().entries["run/step_5.pt"] == recorded
    with mirror.open_read("run/step_5.pt") as stream:
        assert stream.read() == mine
