"""Resources of the daemon while it mirrors a lot of data: peak RSS, CPU seconds per GB, idle CPU,
and the page-cache footprint afterwards (with and without `io.drop_cache`).

The checkpoints are hard links to the throughput datasets (committed by rename, as a trainer does),
so 10 GB of input costs no extra disk space; every link is copied and hashed on its own.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import (
    GB,
    Log,
    ManifestWatcher,
    MiB,
    cached_bytes,
    log,
    proc_cpu_seconds,
    proc_status,
    resident_bytes,
    warm,
)
from tests.support.config import BENCH
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


def measure(
    work: Path, sources: list[Path], copies: int, drop_cache: bool, idle_seconds: float, say: Log = log
) -> dict[str, Any]:
    """Mirror ``copies`` x every file under ``sources`` through a running daemon; sample it throughout."""
    root = work / f"resources-{'drop' if drop_cache else 'keep'}"
    shutil.rmtree(root, ignore_errors=True)
    primary, mirror = root / "primary", root / "mirror"
    primary.mkdir(parents=True)
    mirror.mkdir(parents=True)
    files = [(src, p) for src in sources for p in sorted(src.rglob("*.pt"))]
    total = copies * sum(p.stat().st_size for _, p in files)
    with DaemonProcess(root, primary, mirror, {"io": {"drop_cache": drop_cache}}, base=BENCH) as daemon:
        pid = daemon.pid
        idle_rss = proc_status(pid)["VmRSS"]
        warm(p for _, p in files)
        cache0 = cached_bytes()
        cpu0, t0 = proc_cpu_seconds(pid), time.perf_counter()
        rels = []
        for k in range(copies):
            for src, p in files:
                rel = f"set{k}/{src.name}/{p.relative_to(src)}"
                final = primary / rel
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = final.with_name(final.name + ".tmp")
                os.link(p, tmp)
                tmp.replace(final)
                rels.append(rel)
        manifest = ManifestWatcher(mirror)
        peak_rss = 0

        def done() -> bool:
            nonlocal peak_rss
            peak_rss = max(peak_rss, proc_status(pid)["VmRSS"])
            return len(manifest.refresh()) >= len(rels)

        wait_for(done, 3600, f"{len(rels)} files on the mirror", interval=0.1)
        seconds = time.perf_counter() - t0
        cpu = proc_cpu_seconds(pid) - cpu0
        hwm = proc_status(pid)["VmHWM"]
        cache1 = cached_bytes()
        mirror_res = resident_bytes([mirror / r for r in rels])
        source_res = resident_bytes([p for _, p in files])
        c0 = proc_cpu_seconds(pid)
        time.sleep(idle_seconds)  # the measurement window itself, not a synchronisation
        idle_cpu = proc_cpu_seconds(pid) - c0
    result = {
        "drop_cache": drop_cache,
        "files": len(rels),
        "bytes": total,
        "seconds": round(seconds, 2),
        "gb_per_s": round(total / seconds / GB, 3),
        "idle_rss_mib": round(idle_rss / MiB, 1),
        "peak_rss_mib": round(max(hwm, peak_rss) / MiB, 1),
        "cpu_s": round(cpu, 2),
        "cpu_s_per_gb": round(cpu / (total / GB), 3),
        "cache_delta_mib": round((cache1 - cache0) / MiB),
        "mirror_resident_mib": None if mirror_res is None else round(mirror_res / MiB),
        "source_resident_mib": None if source_res is None else round(source_res / MiB),
        "idle_seconds": idle_seconds,
        "idle_cpu_percent": round(100 * idle_cpu / idle_seconds, 3),
    }
    say(f"  resources drop_cache={drop_cache}: {result}")
    shutil.rmtree(root, ignore_errors=True)
    return result
