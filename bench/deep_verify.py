"""What does `mirrord verify --deep` cost compared with plain hashing?

Writes one torch.save checkpoint (~2 GiB: large random float32 tensors plus many small ones, as a
real model has), brings it into the page cache, then times in paired repetitions (every repetition
runs every variant once, in a rotated order) on the same file in the same run:

  read only            8 MiB readinto loop: the ceiling any check can reach from the page cache
  deep verify          mirrord.formats.zipcheck.check_torch_zip (every record's CRC-32)
  zipfile.testzip      the standard library's own CRC walk, for reference
  blake3 / sha256      tests.support.mirror.hash_file (mirrord.store.hashing.hash_stream), what `mirrord verify` does
  load (mmap)          mirrord.formats.zipcheck.load_check, the extra cost of `--load`

Run: ``python bench/deep_verify.py [--size 2G] [--reps 5] [--workdir DIR] [--keep]``.
Results: bench/results/deep_verify.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mirrord.formats.zipcheck import check_torch_zip, load_check
from tests.support.mirror import hash_file

if __package__ in (None, ""):  # run as a script (python bench/X.py): make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import GB, GiB, MiB, parse_size, random_tensors

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Variant:
    name: str
    fn: Callable[[Path], str]  # returns a result that must be the same on every run
    reads_every_byte: bool = True
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    results: set[str] = field(default_factory=set)


def read_only(path: Path) -> str:
    buf = bytearray(8 * MiB)
    total = 0
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            total += n
    return str(total)


def deep(path: Path) -> str:
    return check_torch_zip(path).status


def testzip(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        return str(zf.testzip())


def hashed(algo: str) -> Callable[[Path], str]:
    return lambda path: hash_file(path, algo)


def load(path: Path) -> str:
    return load_check(path).status


def make_checkpoint(path: Path, size: int) -> str:
    """Large random tensors (64 MiB each) plus 256 small ones (biases, norms, optimizer scalars)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {f"block{i}.norm": torch.randn(1024, generator=gen) for i in range(256)}
    weights = random_tensors(gen, (size - 256 * 4096) // 4, "block")
    state.update(weights)
    state["step"] = 1000
    torch.save(state, path)
    return f"torch.save of {len(weights)} random float32 tensors of <=64 MiB + 256 of 4 KiB (torch {torch.__version__})"


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def warm(path: Path) -> None:
    read_only(path)


def run_paired(variants: list[Variant], path: Path, reps: int, log: Callable[[str], None]) -> None:
    """Rotate the order each repetition so no variant always runs right after the same neighbour."""
    for rep in range(reps):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            warm(path)
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            v.results.add(v.fn(path))
            v.seconds.append(time.perf_counter() - t0)
            v.cpu_seconds.append(cpu_seconds() - c0)
            log(f"  rep {rep + 1}/{reps} {v.name:34s} {v.seconds[-1]:7.3f}s  cpu {v.cpu_seconds[-1]:6.2f}s")


def summarize(variants: list[Variant], size: int) -> list[dict[str, Any]]:
    base = next(v for v in variants if v.name.startswith("blake3"))
    rows = []
    for v in variants:
        med = statistics.median(v.seconds)
        ratios = [s / b for s, b in zip(v.seconds, base.seconds, strict=True)]
        rows.append(
            {
                "variant": v.name,
                "median_s": round(med, 3),
                "min_s": round(min(v.seconds), 3),
                "max_s": round(max(v.seconds), 3),
                "gb_per_s": round(size / med / GB, 2) if v.reads_every_byte else None,
                "cpu_s_per_gb": round(statistics.median(v.cpu_seconds) / (size / GB), 3),
                "median_ratio_to_blake3": round(statistics.median(ratios), 2),
                "results": sorted(v.results),
                "consistent": len(v.results) == 1,
                "runs_s": [round(s, 3) for s in v.seconds],
            }
        )
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Deep verify vs plain hashing (bench/deep_verify.py)",
        "",
        f"- File: {meta['file_bytes'] / GiB:.2f} GiB, {meta['file_kind']}",
        f"- Machine: {meta['cpus']} CPUs, {meta['kernel']}, Python {meta['python']}, zlib {meta['zlib']}",
        f"- File in page cache before every run; {meta['reps']} paired repetitions, medians, order rotated",
        "- 1-minute load average before / after: {} / {} (other work on the machine slows every variant)".format(
            *meta["loadavg_1min_before_after"]
        ),
        "- GB = 1e9 bytes. Ratio: median over repetitions of variant time / blake3 time in that repetition.",
        "- load (mmap) maps the tensors without reading them, so it has no GB/s.",
        "",
        "| variant | median s | GB/s | CPU s/GB | time ratio to blake3 | result |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] is not None else "-"
        result = r["results"][0] if r["consistent"] else f"INCONSISTENT {r['results']}"
        if len(result) > 20:
            result = result[:16] + "..."
        lines.append(
            f"| {r['variant']} | {r['median_s']:.3f} | {gbs} | {r['cpu_s_per_gb']:.3f} | "
            f"{r['median_ratio_to_blake3']:.2f} | {result} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size", default="2G", help="checkpoint size, e.g. 2G, 512M (default 2G)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mirrord-bench-deep")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint for the next run")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    args = parser.parse_args(argv)

    size = parse_size(args.size)
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / f"checkpoint_{size}.pt"
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = os.getloadavg()[0]
    if path.exists() and check_torch_zip(path).ok:
        kind = "torch.save checkpoint reused from a previous run (--keep)"
    else:
        print(f"writing {size / GiB:.2f} GiB checkpoint to {path} ...", flush=True)
        kind = make_checkpoint(path, size)
    file_bytes = path.stat().st_size

    variants = [
        Variant("read only (8 MiB readinto)", read_only),
        Variant("deep verify", deep),
        Variant("zipfile.testzip (stdlib)", testzip),
        Variant("blake3 (hashing.hash_file)", hashed("blake3")),
        Variant("sha256 (hashing.hash_file)", hashed("sha256")),
        Variant("load (mmap, weights_only)", load, reads_every_byte=False),
    ]
    try:
        run_paired(variants, path, args.reps, lambda line: print(line, flush=True))
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)

    import zlib

    meta = {
        "file_bytes": file_bytes,
        "file_kind": kind,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "zlib": zlib.ZLIB_RUNTIME_VERSION,
        "reps": args.reps,
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    rows = summarize(variants, file_bytes)
    text = markdown(meta, rows)
    print()
    print(text)
    if not args.no_write:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "deep_verify.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        (RESULTS_DIR / "deep_verify.md").write_text(text)
    bad = [r["variant"] for r in rows if not r["consistent"]]
    deep_ok = all(r["results"] == ["ok"] for r in rows if r["variant"].startswith(("deep", "load")))
    return 0 if not bad and deep_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
