"""Throughput: `mirrord sync` against the usual tools, on the same files, same run, paired repetitions.

Every case starts from an empty destination directory on the same disk, with the source in the page
cache (as after the trainer wrote it) and nothing dirty, and ends with the data durable: `cp` and
`rclone` are followed by `sync`, rsync runs with `--fsync`, the Python baselines and mirrord fsync each
file and directory. Ratios are wall time divided by `cp` + `sync` in the same repetition.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Case, Dataset, Log, ensure_dataset, log, run_paired, summarize, tree_bytes, warm

BASELINE = "cp+sync"
REPO = Path(__file__).resolve().parent.parent  # `python -m bench.tools` must resolve from anywhere


def mirrord_env(**settings: str) -> dict[str, str]:
    """The caller's environment without MIRRORD_* settings, plus ``settings`` (MIRRORD_<KEY>=value).

    mirrord runs as installed: pip byte-compiles a wheel, so start-up loads bytecode. A checkout run
    with PYTHONDONTWRITEBYTECODE (as CI sets) would compile every mirrord module on every `mirrord
    sync` instead (0.2-0.5 s of CPU that no installed copy pays): the bytecode is kept in a scratch
    folder of the system's temporary directory, never in the source tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "mirrord-bench-bytecode"))
    env.update({f"MIRRORD_{k.upper()}": v for k, v in settings.items()})
    return env


def mirrord_sync(src: Path, dst: Path, **settings: str) -> None:
    """One `mirrord sync` pass in its own process (start-up included, as a user would run it). Retention
    is off unless asked for: with the default keep_last, older steps of a dataset kept for more than
    prune.min_age_seconds are retired, not copied, and the cases would not do the same work."""
    env = mirrord_env(
        **{
            "copy__settle_seconds": "0",
            "log__format": "json",
            "prune__enabled": "false",
            "io__bandwidth_limit": "0",
            **settings,
        }
    )  # the copy's own speed, against cp
    subprocess.run(
        [sys.executable, "-m", "mirrord", "sync", "--primary", str(src), "--mirror", str(dst)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def startup_seconds(work: Path, reps: int) -> float:
    """Median wall time of `mirrord sync` with nothing to copy: the fixed cost every pass pays."""
    src, dst = work / "empty-primary", work / "empty-mirror"
    times = []
    for _ in range(max(reps, 3)):
        shutil.rmtree(dst, ignore_errors=True)
        src.mkdir(parents=True, exist_ok=True)
        dst.mkdir(parents=True)
        t0 = time.perf_counter()
        mirrord_sync(src, dst)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 3)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)


def tools(src: Path, dst: Path, full: bool) -> dict[str, Callable[[], None]]:
    """The copy commands under test, by name; ones whose program is missing are left out."""

    def cp_sync() -> None:
        _sh("cp", "-r", f"{src}/.", f"{dst}/")
        _sh("sync")

    def rclone_sync() -> None:
        # rclone never fsyncs; the sync makes it as durable as the others.
        _sh("rclone", "copy", "--config", "", str(src), str(dst))
        _sh("sync")

    out: dict[str, Callable[[], None]] = {
        BASELINE: cp_sync,
        "rsync --fsync": lambda: _sh("rsync", "-a", "--fsync", f"{src}/", f"{dst}/"),
        "rclone copy+sync": rclone_sync,
        "shutil.copy2+fsync": lambda: _sh(sys.executable, "-m", "bench.tools", "shutil", str(src), str(dst)),
        "mirrord sync": lambda: mirrord_sync(src, dst),
    }
    if full:
        out["naive py sha256"] = lambda: _sh(sys.executable, "-m", "bench.tools", "naive", str(src), str(dst))
    for name, prog in (("rsync --fsync", "rsync"), ("rclone copy+sync", "rclone")):
        if shutil.which(prog) is None:
            del out[name]
    return out


def bench_dataset(
    ds: Dataset,
    data_root: Path,
    work: Path,
    reps: int,
    full: bool,
    extra: dict[str, dict[str, str]] | None = None,
    say: Log = log,
) -> dict[str, Any]:
    """Time every tool (and mirrord with each ``extra`` setting set) on one dataset."""
    src, kind = ensure_dataset(ds, data_root, say)
    dst = work / "mirror"
    files = ds.files(src)
    nbytes = tree_bytes(src)
    expected = {p.relative_to(src): p.stat().st_size for p in files}

    def reset() -> None:
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        os.sync()
        warm(files)

    def check() -> None:
        got = {p.relative_to(dst): p.stat().st_size for p in dst.rglob("*.pt")}
        if got != expected:
            raise RuntimeError(f"{ds.name}: destination differs from source ({len(got)} of {len(expected)} files)")

    runs = tools(src, dst, full)
    for name, settings in (extra or {}).items():
        runs[name] = functools.partial(mirrord_sync, src, dst, **settings)
    cases = [Case(name, fn, check) for name, fn in runs.items()]
    run_paired(cases, reset, reps, say, label=ds.name)
    shutil.rmtree(dst, ignore_errors=True)
    return {
        "dataset": ds.name,
        "files": len(files),
        "bytes": nbytes,
        "file_kind": kind,
        "rows": summarize(cases, nbytes, BASELINE),
    }
