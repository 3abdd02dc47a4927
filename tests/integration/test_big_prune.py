"""A prune pass of thousands of deletions inside the running daemon: it keeps its heartbeat (/healthz 200),
mirrors a checkpoint committed meanwhile, honours SIGTERM in the middle, and leaves a manifest that
records exactly the files still there."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from mirrord.core.model import ManifestEntry
from mirrord.store.manifest import Manifest
from tests.support.checkpoints import BASE_MTIME_NS, save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.mirror import hash_file, mirror_files
from tests.support.wait import wait_for

RUNS = 10
OLD_STEPS = 340  # per run: 3,400 deletions
KEEP = 2
# Each unlink is made to take 30 ms (strace's delay injection), so the pass lasts ~100 s: long enough to
# watch, and far longer than the heartbeat's staleness limit if the loop did not beat between deletions.
DELAY_US = 30_000

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def _build(tmp_path: Path) -> tuple[Path, Path, set[str]]:
    """Primary: KEEP real checkpoints per run, mirrored by `mirrord sync`. Mirror: also OLD_STEPS older
    steps per run (recorded, gone from the primary): retention deletes all of them."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    kept = set()
    for r in range(RUNS):
        for step in range(1000, 1000 + KEEP):
            save_checkpoint(primary / f"run_{r}" / f"step_{step:06d}.pt", step)
            kept.add(f"run_{r}/step_{step:06d}.pt")
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 0, result.stderr
    blob = save_checkpoint(tmp_path / "old.pt", 1).read_bytes()
    # Older than the kept steps (save_checkpoint dates step N at BASE_MTIME_NS + N s): a lower step with
    # a newer mtime would be a rollback's new branch, and retention would keep it instead (issue 14).
    digest, old_ns = hash_file(tmp_path / "old.pt", "blake3"), BASE_MTIME_NS - 3600 * 10**9
    entries = []
    for r in range(RUNS):
        for step in range(OLD_STEPS):
            rel = f"run_{r}/step_{step:06d}.pt"
            (mirror / rel).write_bytes(blob)
            os.utime(mirror / rel, ns=(old_ns, old_ns))
            entries.append(ManifestEntry(rel, len(blob), "blake3", digest, old_ns, step, time.time()))
    manifest = Manifest.open(mirror)
    manifest.apply(puts=entries)
    manifest.close()
    (primary / "run_new").mkdir()  # watched from the start: the test commits a checkpoint there mid-prune
    return primary, mirror, kept


def _pid_of(d) -> int:
    return int(d.wait_event("daemon.starting", timeout=60)["pid"])


def test_a_3400_file_prune_keeps_the_daemon_alive_and_stoppable(tmp_path: Path, daemon_factory) -> None:
    primary, mirror, kept = _build(tmp_path)
    assert len(mirror_files(mirror)) == RUNS * (OLD_STEPS + KEEP)
    d = daemon_factory(
        {
            "prune": {"enabled": True, "keep_last": KEEP, "min_age_seconds": 0},
            "daemon": {"heartbeat_seconds": 2, "shutdown_grace_seconds": 5},
            "log": {"level": "info"},
        },
        wrapper=[
            "strace",
            "-f",
            "-qq",
            "-o",
            os.devnull,
            "-e",
            "trace=unlinkat",
            "-e",
            f"inject=unlinkat:delay_exit={DELAY_US}",
        ],
    )
    d.start(wait_ready=False)
    pid = _pid_of(d)
    try:
        wait_for(lambda: len(d.events("prune.deleted")) >= 20, 120, "the prune pass to be under way")
        # While it deletes: the supervisor heartbeat goes on (a stale one makes /healthz 503).
        probes = []
        while len(probes) < 40:
            code, body = d.http("/healthz")
            probes.append((code, body))
            time.sleep(0.1)
        assert all(code == 200 for code, _ in probes), [p for p in probes if p[0] != 200][:3]
        # A checkpoint committed now is mirrored and recorded while the pass goes on.
        new = primary / "run_new" / "step_002000.pt"
        save_checkpoint(new.with_name(new.name + ".part"), 2000).replace(new)
        wait_for(lambda: "run_new/step_002000.pt" in Manifest.load(mirror).entries, 60, "the new checkpoint")
        assert (mirror / "run_new" / "step_002000.pt").read_bytes() == new.read_bytes()
        assert not d.events("prune.finished"), "the pass ended too early to show anything"
        os.kill(pid, signal.SIGTERM)
        assert d.proc.wait(timeout=120) == 0, d.log_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    finished = d.events("prune.finished")
    assert finished and finished[0]["interrupted"] is True, "SIGTERM did not interrupt the prune pass"
    assert d.events("daemon.stopped")
    deleted = len(d.events("prune.deleted"))
    assert 0 < deleted < RUNS * OLD_STEPS
    # The manifest records exactly the files still there: none deleted is vouched for, none left is lost.
    left = mirror_files(mirror)
    assert set(Manifest.load(mirror).entries) == set(left)
    assert len(left) == RUNS * (OLD_STEPS + KEEP) + 1 - deleted
    kept.add("run_new/step_002000.pt")

    # A restart without the delay finishes the job.
    d2 = daemon_factory({"prune": {"enabled": True, "keep_last": KEEP, "min_age_seconds": 0}}).start()
    wait_for(lambda: set(mirror_files(mirror)) == kept, 180, "the rest of the prune")
    assert d2.stop() == 0
    assert set(Manifest.load(mirror).entries) == kept
    assert sorted(p.name for p in primary.glob("run_0/*.pt")) == ["step_001000.pt", "step_001001.pt"]
