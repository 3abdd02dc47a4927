"""Scale: reconcile cost for 10,000 and 100,000 checkpoints across 1,000 run folders.

A reconcile is what `mirrord sync` and the daemon's rescans do before copying anything: load the
manifest, list the primary and the mirror, plan. The trees hold empty `*.pt`
files (the cost is per file, not per byte) with a mirror and manifest that are fully in sync, so the plan
is empty, as in the steady state. Each size is measured in fresh processes (one cold pass, then the
median of five) so its peak RSS is its own (the listing child's is reported beside it). Also timed:
planning against an empty manifest (everything new), persisting one manifest entry at that size, and the
whole `mirrord sync` command on the in-sync tree.

`daemon_passes` times what a running daemon does at each rescan, which is more than those four steps:
it holds the manifest (never read again), and plans retention over every file, observes both listings
for the min-age guard, runs the prune pass, and checks naming and rollbacks. It runs `mirrord run` on
the same tree, retention on but keeping every step (nothing is deleted), rescanning every second, and
reads the duration of each full reconcile from the daemon's own `reconcile.finished` events.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Log, MiB, log, proc_cpu_seconds, proc_status
from bench.throughput import REPO, mirrord_env

STEADY_PASSES = 5  # fresh processes after the first, each a whole reconcile (~3 s at 100,000 files; 2 at 1,000,000)


def build_tree(root: Path, n_files: int, n_runs: int, say: Log = log) -> Path:
    """primary/ and mirror/ with ``n_files`` files over ``n_runs`` folders, and an in-sync manifest."""
    from mirrord.core.model import ManifestEntry
    from mirrord.store.hashing import new_hasher
    from mirrord.store.manifest import MANIFEST_NAME, encode_snapshot

    where = root / f"scale-{n_files}"
    if (where / ".complete").exists():
        return where
    shutil.rmtree(where, ignore_errors=True)
    say(f"making scale tree: {n_files} files in {n_runs} run folders")
    t0 = time.perf_counter()
    empty = new_hasher("blake3").hexdigest()
    entries = {}
    mtime = time.time_ns() - 3600 * 10**9
    for i in range(n_files):
        run = f"run_{i % n_runs:04d}"
        rel = f"{run}/step_{i // n_runs:06d}.pt"
        for side in ("primary", "mirror"):
            p = where / side / rel
            if i < n_runs:
                p.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644))
            os.utime(p, ns=(mtime, mtime))
        entries[rel] = ManifestEntry(rel, 0, "blake3", empty, mtime, i // n_runs, time.time())
    (where / "mirror" / MANIFEST_NAME).write_bytes(encode_snapshot(entries))
    (where / ".complete").write_text("")
    say(f"  made in {time.perf_counter() - t0:.1f} s")
    return where


def _measure_here(where: Path) -> dict[str, Any]:
    """Runs inside the child process: the reconcile as `mirrord sync` makes it (manifest, primary, mirror, plan)."""
    from mirrord.core.model import ManifestEntry
    from mirrord.core.plan import plan_copies
    from mirrord.store.manifest import MANIFEST_NAME, Manifest, encode_snapshot
    from mirrord.store.scan import snapshot_tree
    from mirrord.store.volume import LocalMirror

    patterns = ("*.pt",)
    step = re.compile(r"step_(\d+)")
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak (fork copies it).
    rss0 = proc_status(os.getpid())["VmHWM"]
    t: dict[str, float] = {}
    c0 = time.process_time()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    mirror = LocalMirror(where / "mirror")
    t0 = time.perf_counter()
    manifest = Manifest.load(where / "mirror")
    t["manifest_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    psnap = snapshot_tree(where / "primary", patterns)
    t["scan_primary_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    msnap = mirror.snapshot(patterns)
    t["scan_mirror_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = plan_copies(psnap, msnap, manifest.entries, step)
    t["plan_s"] = time.perf_counter() - t0
    if plan.jobs:
        raise RuntimeError(f"expected an in-sync tree, planner wants {len(plan.jobs)} copies")
    t["reconcile_s"] = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    t["reconcile_cpu_s"] = time.process_time() - c0
    t["child_cpu_s"] = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
    t0 = time.perf_counter()
    all_new = plan_copies(psnap, msnap, {}, step)
    t["plan_all_new_s"] = time.perf_counter() - t0
    peak = proc_status(os.getpid())["VmHWM"]
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        (Path(tmp) / MANIFEST_NAME).write_bytes(encode_snapshot(manifest.entries))
        bound = Manifest.open(Path(tmp))
        e = next(iter(manifest.entries.values()))
        # The first change also creates the journal; the steady state is one append + fsync.
        bound.record(ManifestEntry("extra/step_000000.pt", 1, e.algo, e.digest, e.source_mtime_ns, 0, time.time()))
        t0 = time.perf_counter()
        bound.record(ManifestEntry("extra/step_000001.pt", 1, e.algo, e.digest, e.source_mtime_ns, 1, time.time()))
        t["manifest_record_s"] = time.perf_counter() - t0
        manifest_bytes = (Path(tmp) / MANIFEST_NAME).stat().st_size
    return {
        "files": len(psnap.files),
        "jobs_all_new": len(all_new.jobs),
        **{k: round(v, 4) for k, v in t.items()},
        "reconcile_peak_rss_growth_mib": round((peak - rss0) / MiB, 1),
        "reconcile_peak_rss_mib": round(peak / MiB, 1),
        # ru_maxrss of the listing child (KiB): its own, as it is a fresh interpreter, not a fork
        "child_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "manifest_mib": round(manifest_bytes / MiB, 2),
    }


def measure(root: Path, n_files: int, n_runs: int, say: Log = log, sync_command: bool = True) -> dict[str, Any]:
    """Build (or reuse) the tree, time the reconcile in a child process and (`sync_command`) the whole
    `mirrord sync`."""
    where = build_tree(root, n_files, n_runs, say)
    os.sync()
    runs = []
    # The first pass reads the inodes from the disk; the next ones are the steady state, of which the median
    # (by reconcile time) is reported, with each pass's time beside it.
    for _ in range(1 + (STEADY_PASSES if n_files <= 100_000 else 2)):
        out = subprocess.run(
            [sys.executable, "-m", "bench.scale", str(where)], check=True, capture_output=True, text=True, cwd=REPO
        ).stdout
        runs.append(json.loads(out))
    steady = sorted(runs[1:], key=lambda r: r["reconcile_s"])
    result: dict[str, Any] = {
        "runs": n_runs,
        **steady[len(steady) // 2],
        "passes_s": [r["reconcile_s"] for r in runs[1:]],
        "first_pass": {k: v for k, v in runs[0].items() if k.endswith("_s")},
    }
    if not sync_command:
        say(f"  scale {n_files}: {result}")
        return result
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mirrord",
            "sync",
            "--primary",
            str(where / "primary"),
            "--mirror",
            str(where / "mirror"),
        ],
        check=True,
        env=mirrord_env(copy__settle_seconds="0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result["sync_command_s"] = round(time.perf_counter() - t0, 3)
    say(f"  scale {n_files}: {result}")
    return result


def daemon_passes(where: Path, passes: int = 4, say: Log = log) -> dict[str, Any]:
    """`mirrord run` on the in-sync tree `where` (build_tree): its first full reconcile, then `passes`
    rescans; seconds of each as the daemon logs it, its CPU seconds per rescan (its CPU time from the end
    of the first pass to the end of the last, over the rescans: it idles between them), its peak RSS."""
    from tests.support.config import BENCH
    from tests.support.daemon import DaemonProcess
    from tests.support.wait import wait_for

    work = where.parent / f"{where.name}-daemon"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    # keep_last above the steps of any run: retention plans over every file and deletes nothing.
    settings = {"prune": {"enabled": True, "keep_last": 1_000_000}, "watch": {"rescan_interval_seconds": 1}}
    try:
        # Ready after its first reconcile: most of a minute at 1,000,000 files, more on a loaded machine.
        with DaemonProcess(
            work, where / "primary", where / "mirror", settings, base=BENCH, ready_seconds=1800
        ) as daemon:
            wait_for(lambda: len(daemon.events("reconcile.finished")) >= 1, 1800, "the first reconcile", 0.05)
            cpu0, child0 = proc_cpu_seconds(daemon.pid), proc_cpu_seconds(daemon.pid, children=True)
            wait_for(
                lambda: len(daemon.events("reconcile.finished")) >= passes + 1, 600 * passes, f"{passes} rescans", 0.05
            )
            cpu = proc_cpu_seconds(daemon.pid) - cpu0
            child_cpu = proc_cpu_seconds(daemon.pid, children=True) - child0  # the mirror's listing children
            listed_by = sorted({e.get("mirror_listed_by", "?") for e in daemon.events("reconcile.finished")})
            hwm = proc_status(daemon.pid)["VmHWM"]
            seconds = [e["seconds"] for e in daemon.events("reconcile.finished")][: passes + 1]
            if any(e["queued"] for e in daemon.events("reconcile.finished")):
                raise RuntimeError("expected an in-sync tree, the daemon queued copies")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steady = sorted(seconds[1:])
    result = {
        "first_s": seconds[0],
        "rescans_s": seconds[1:],
        "median_s": steady[len(steady) // 2],
        "cpu_s_per_rescan": round(cpu / passes, 3),
        "child_cpu_s_per_rescan": round(child_cpu / passes, 3),
        "mirror_listed_by": listed_by,
        "peak_rss_mib": round(hwm / MiB, 1),
    }
    say(f"  daemon rescans of {where.name}: {result}")
    return result


if __name__ == "__main__":
    print(json.dumps(_measure_here(Path(sys.argv[1]))))
