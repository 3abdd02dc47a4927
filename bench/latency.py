"""Latency: commit on the primary (the rename onto the final name) -> final name + manifest entry on the mirror.

The trainer side writes a small real checkpoint to a temporary name and fsyncs it outside the timed
window; the clock starts at `os.replace` onto the final name and stops when the mirror has the file
under its final name and the manifest records it (the manifest is read whenever its file changes,
polled every millisecond).
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import Log, ManifestWatcher, log, percentile
from tests.support.config import BENCH
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


def checkpoint_bytes(size: int, seed: int) -> bytes:
    """A torch.save checkpoint of about ``size`` bytes, in memory; random bytes without torch."""
    try:
        import torch
    except ImportError:
        return os.urandom(size)
    buf = io.BytesIO()
    gen = torch.Generator().manual_seed(seed)
    torch.save({"w": torch.randn(max(1, size // 4), generator=gen), "step": seed}, buf)
    return buf.getvalue()


def _mirrored(manifest: ManifestWatcher, mirror: Path, rel: str) -> bool:
    return rel in manifest.refresh() and (mirror / rel).exists()


def measure(
    work: Path, mode: str, samples: int, size: int, settings: dict[str, Any] | None = None, say: Log = log
) -> dict[str, Any]:
    """Commit ``samples`` checkpoints one after another with the daemon in watch ``mode``."""
    root = work / f"latency-{mode}"
    shutil.rmtree(root, ignore_errors=True)
    primary, mirror = root / "primary", root / "mirror"
    run = primary / "run_a"
    run.mkdir(parents=True)
    mirror.mkdir(parents=True)
    config: dict[str, Any] = {"watch": {"mode": mode}}
    for key, value in (settings or {}).items():
        config.setdefault(key, {}).update(value)
    blobs = [checkpoint_bytes(size, i + 1) for i in range(samples)]
    latencies: list[float] = []
    with DaemonProcess(root, primary, mirror, config, base=BENCH) as daemon:
        manifest = ManifestWatcher(mirror)
        for i, blob in enumerate(blobs):
            name = f"step_{i:05d}.pt"
            tmp = run / f"{name}.tmp"
            with tmp.open("wb") as fh:
                fh.write(blob)
                fh.flush()
                os.fsync(fh.fileno())
            rel = f"run_a/{name}"
            t0 = time.perf_counter()
            tmp.replace(run / name)
            wait_for(functools.partial(_mirrored, manifest, mirror, rel), 60, f"{rel} on the mirror", interval=0.001)
            latencies.append(time.perf_counter() - t0)
        pid = daemon.pid
    ms = [x * 1000 for x in latencies]
    say(f"  latency {mode}: p50 {percentile(ms, 50):.1f} ms  p99 {percentile(ms, 99):.1f} ms  (n={len(ms)})")
    shutil.rmtree(root, ignore_errors=True)
    return {
        "mode": mode,
        "samples": len(ms),
        "checkpoint_bytes": len(blobs[0]) if blobs else 0,
        "p50_ms": round(percentile(ms, 50), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "min_ms": round(min(ms), 1),
        "max_ms": round(max(ms), 1),
        "daemon_pid": pid,
        "settings": config,
        "all_ms": [round(x, 1) for x in ms],
    }
