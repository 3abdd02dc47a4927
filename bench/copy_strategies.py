"""Choose mirrord's copy path by measurement.

Copies one large checkpoint from one directory to another on the same disk with several
strategies, side by side in the same run, in paired repetitions (every repetition runs every
variant once, in a rotated order), and reports medians and ratios to ``cp`` + ``sync``.
Every variant ends with the file and its directory durable (fsync of both, or ``sync``).

Run: ``python bench/copy_strategies.py [--size 2G] [--reps 3] [--workdir DIR]``.
Needs root only for ``--cold`` (drops the page cache between runs).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import io
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import blake3
import xxhash

if __package__ in (None, ""):  # run as a script (python bench/X.py): make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    GB,
    GiB,
    MiB,
    cached_bytes,
    cpu_seconds_self_and_children,
    device_of,
    drop_caches,
    log,
    make_checkpoint,
    parse_size,
    warm,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class Hasher(Protocol):
    """The part of a hash object the copy loops use."""

    def update(self, data: Any, /) -> Any: ...
    def hexdigest(self) -> str: ...


HASHERS: dict[str, Callable[[], Hasher]] = {
    "blake3": lambda: blake3.blake3(),
    "blake3_auto": lambda: blake3.blake3(max_threads=blake3.blake3.AUTO),
    "sha256": lambda: hashlib.sha256(),
    "xxh3_128": lambda: xxhash.xxh3_128(),
}

# sync_file_range(2) is not in the os module; it is what lets writeback start behind the copy
# so DONTNEED can actually drop the pages (DONTNEED ignores dirty pages).
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """Start (or wait for) writeback of a byte range; raises OSError like the os module."""
    if _libc.sync_file_range(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# ---------------------------------------------------------------------------------------------
# Durability helpers shared by every Python variant.


def fsync_dir(path: Path) -> None:
    """Make a new directory entry durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_pair(src: Path, dst: Path) -> tuple[int, int]:
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except BaseException:
        os.close(sfd)
        raise
    return sfd, dfd


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _finish(dfd: int, dst: Path) -> None:
    os.fsync(dfd)
    os.close(dfd)
    fsync_dir(dst.parent)


def _hash_fd(fd: int, algo: str, bufsize: int = 8 * MiB) -> str:
    hasher = HASHERS[algo]()
    buf = bytearray(bufsize)
    view = memoryview(buf)
    reader = io.FileIO(fd, "rb", closefd=False)
    while n := reader.readinto(buf):
        hasher.update(view[:n])
    return hasher.hexdigest()


# ---------------------------------------------------------------------------------------------
# Copy variants: each copies src -> dst, makes it durable, returns the digest (or "").


def copy_cp_sync(src: Path, dst: Path) -> str:
    """The baseline everyone knows: coreutils cp (copy_file_range inside), then a global sync."""
    subprocess.run(["cp", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    return ""


def copy_cp_fsync(src: Path, dst: Path) -> str:
    """cp, then fsync of just this file and its directory instead of a global sync."""
    subprocess.run(["cp", str(src), str(dst)], check=True)
    fd = os.open(dst, os.O_RDONLY)
    _finish(fd, dst)
    return ""


def copy_shutil_fsync(src: Path, dst: Path) -> str:
    """shutil.copy2 (sendfile on Linux) + fsync: the obvious pure-Python answer."""
    shutil.copy2(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    _finish(fd, dst)
    return ""


class DropBehind:
    """Stream writeback behind the copy and drop what is already on disk from the page cache.

    After each chunk: start its writeback (sync_file_range WRITE, asynchronous). Once more than
    two windows are written, wait for the oldest window to reach the disk and DONTNEED it on both
    files. The copy then holds about two windows of cache, reuses the same free pages, and the
    final fsync only has the tail left to write.
    """

    def __init__(self, sfd: int, dfd: int, window: int = 64 * MiB, drop_cache: bool = True) -> None:
        self.sfd, self.dfd, self.window, self.drop_cache = sfd, dfd, window, drop_cache
        self.written = 0
        self.dropped = 0

    def wrote(self, n: int) -> None:
        """Account for ``n`` bytes just written at the current end of the file."""
        sync_file_range(self.dfd, self.written, n, _SFR_WRITE)
        self.written += n
        while self.written - self.dropped >= 2 * self.window:
            sync_file_range(self.dfd, self.dropped, self.window, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            if self.drop_cache:
                os.posix_fadvise(self.dfd, self.dropped, self.window, os.POSIX_FADV_DONTNEED)
                os.posix_fadvise(self.sfd, self.dropped, self.window, os.POSIX_FADV_DONTNEED)
            self.dropped += self.window

    def finish(self) -> None:
        """After the fsync: everything is clean, drop the rest."""
        if not self.drop_cache:
            return
        os.posix_fadvise(self.dfd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(self.sfd, 0, 0, os.POSIX_FADV_DONTNEED)


def make_loop(bufsize: int, algo: str, drop: str = "none", window: int = 64 * MiB) -> Callable[[Path, Path], str]:
    """Read/write loop with one reusable buffer; the hash is fed from the bytes that are written.

    drop="end": posix_fadvise(DONTNEED) on both files after the fsync.
    drop="writeback": stream writeback behind the copy (sync_file_range) but keep the cache.
    drop="behind": start writeback of each chunk as it is written (sync_file_range WRITE), and
    once a window is on disk, drop it from the page cache on both files, so the copy never holds
    more than ~2 windows of cache and the final fsync has little left to do.
    """

    def copy(src: Path, dst: Path) -> str:
        sfd, dfd = _open_pair(src, dst)
        hasher = HASHERS[algo]()
        buf = bytearray(bufsize)
        view = memoryview(buf)
        reader = io.FileIO(sfd, "rb", closefd=True)
        behind = DropBehind(sfd, dfd, window, drop_cache=drop == "behind")
        try:
            while n := reader.readinto(buf):
                chunk = view[:n]
                hasher.update(chunk)
                _write_all(dfd, chunk)
                if drop in ("behind", "writeback"):
                    behind.wrote(n)
            os.fsync(dfd)
            if drop == "end":
                os.posix_fadvise(dfd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.posix_fadvise(sfd, 0, 0, os.POSIX_FADV_DONTNEED)
            elif drop == "behind":
                behind.finish()
            os.close(dfd)
            fsync_dir(dst.parent)
        finally:
            reader.close()
        return hasher.hexdigest()

    return copy


def make_cfr(algo: str, hash_from: str, chunk: int = 64 * MiB, drop: bool = False) -> Callable[[Path, Path], str]:
    """os.copy_file_range in the kernel plus a separate hashing read.

    hash_from="dst": after the copy, hash the destination (its pages are still cached);
    "src_after": hash the source after the copy; "src_parallel": a thread hashes the source
    while the kernel copies (both release the GIL).
    """

    def copy(src: Path, dst: Path) -> str:
        sfd, dfd = _open_pair(src, dst)
        size = os.fstat(sfd).st_size
        result: list[str] = []
        thread = None
        try:
            if hash_from == "src_parallel":
                hfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
                thread = threading.Thread(target=lambda: result.append(_hash_fd(hfd, algo)))
                thread.start()
            off = 0
            while off < size:
                n = os.copy_file_range(sfd, dfd, min(chunk, size - off), off, off)
                if n == 0:
                    break
                off += n
            if thread is not None:
                thread.join()
                os.close(hfd)
            elif hash_from == "src_after":
                result.append(_hash_fd(sfd, algo))
            elif hash_from == "dst":
                rfd = os.open(dst, os.O_RDONLY)
                try:
                    result.append(_hash_fd(rfd, algo))
                finally:
                    os.close(rfd)
            os.fsync(dfd)
            if drop:
                os.posix_fadvise(dfd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.posix_fadvise(sfd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(dfd)
            fsync_dir(dst.parent)
        finally:
            os.close(sfd)
        return result[0] if result else ""

    return copy


def make_pipeline(bufsize: int, algo: str, nbuf: int = 4, drop_behind: bool = False) -> Callable[[Path, Path], str]:
    """Three stages on three threads: read chunk N+2 while hashing N+1 and writing N."""

    def copy(src: Path, dst: Path) -> str:
        sfd, dfd = _open_pair(src, dst)
        hasher = HASHERS[algo]()
        free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(nbuf):
            free.put(bytearray(bufsize))
        to_hash: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        to_write: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        errors: list[BaseException] = []
        behind = DropBehind(sfd, dfd) if drop_behind else None

        def hash_stage() -> None:
            while (item := to_hash.get()) is not None:
                hasher.update(memoryview(item[0])[: item[1]])
                to_write.put(item)
            to_write.put(None)

        def write_stage() -> None:
            while (item := to_write.get()) is not None:
                try:
                    if not errors:
                        _write_all(dfd, memoryview(item[0])[: item[1]])
                        if behind is not None:
                            behind.wrote(item[1])
                except OSError as exc:
                    errors.append(exc)
                free.put(item[0])

        threads = [threading.Thread(target=hash_stage), threading.Thread(target=write_stage)]
        for t in threads:
            t.start()
        reader = io.FileIO(sfd, "rb", closefd=False)
        try:
            while not errors:
                buf = free.get()
                n = reader.readinto(buf)
                if not n:
                    break
                to_hash.put((buf, n))
        finally:
            to_hash.put(None)
            for t in threads:
                t.join()
        try:
            if errors:
                os.close(dfd)
                raise errors[0]
            os.fsync(dfd)
            if behind is not None:
                behind.finish()
            os.close(dfd)
        finally:
            os.close(sfd)
        fsync_dir(dst.parent)
        return hasher.hexdigest()

    return copy


def make_mirrord(drop_cache: bool) -> Callable[[Path, Path], str] | None:
    """mirrord's own copier (mirrord.service.copier.copy_file), in process: the copy path without start-up."""
    try:
        from mirrord.service.copier import CopyOptions, copy_file
        from mirrord.store.volume import LocalMirror
    except ImportError:
        return None

    def copy(src: Path, dst: Path) -> str:
        options = CopyOptions(algo="blake3", reserve_bytes=0, drop_cache=drop_cache)
        return copy_file(src.parent, src.name, LocalMirror(dst.parent), options).digest

    return copy


@dataclass(frozen=True)
class Variant:
    """One copy strategy under test."""

    name: str
    group: str
    fn: Callable[[Path, Path], str]
    algo: str | None = None
    note: str = ""


def build_variants(matrix: bool) -> list[Variant]:
    """The strategies of the brief; ``matrix`` runs every buffer size with every hash."""
    v: list[Variant] = [
        Variant("cp+sync", "a", copy_cp_sync, note="baseline"),
        Variant("cp+fsync", "a", copy_cp_fsync),
        Variant("shutil.copy2+fsync", "a", copy_shutil_fsync),
    ]
    sizes = (1, 4, 8, 16)
    algos = tuple(HASHERS) if matrix else ("blake3",)
    for algo in algos:
        for mb in sizes:
            v.append(Variant(f"loop {mb}M {algo}", "b", make_loop(mb * MiB, algo), algo))
    if not matrix:
        for algo in ("blake3_auto", "sha256", "xxh3_128"):
            v.append(Variant(f"loop 8M {algo}", "b", make_loop(8 * MiB, algo), algo))
    v += [
        Variant("cfr + hash dst after", "c", make_cfr("blake3", "dst"), "blake3"),
        Variant("cfr || hash src thread", "c", make_cfr("blake3", "src_parallel"), "blake3"),
        Variant("pipeline 8M blake3", "d", make_pipeline(8 * MiB, "blake3"), "blake3"),
        Variant("pipeline 8M sha256", "d", make_pipeline(8 * MiB, "sha256"), "sha256"),
        Variant("loop 8M blake3 +dontneed end", "e", make_loop(8 * MiB, "blake3", "end"), "blake3"),
        Variant("loop 8M blake3 +dontneed behind", "e", make_loop(8 * MiB, "blake3", "behind"), "blake3"),
        Variant("cfr || hash +dontneed end", "e", make_cfr("blake3", "src_parallel", drop=True), "blake3"),
        Variant(
            "loop 8M blake3 +writeback behind",
            "e",
            make_loop(8 * MiB, "blake3", "writeback"),
            "blake3",
            note="sync_file_range WRITE behind the copy, no DONTNEED",
        ),
        Variant("loop 8M xxh3_128 +dontneed behind", "e", make_loop(8 * MiB, "xxh3_128", "behind"), "xxh3_128"),
        Variant(
            "pipeline 8M blake3 +dontneed behind", "e", make_pipeline(8 * MiB, "blake3", drop_behind=True), "blake3"
        ),
        Variant(
            "pipeline 8M sha256 +dontneed behind", "e", make_pipeline(8 * MiB, "sha256", drop_behind=True), "sha256"
        ),
    ]
    for drop in (True, False):
        fn = make_mirrord(drop)
        if fn is not None:
            v.append(Variant(f"mirrord copier drop_cache={'on' if drop else 'off'}", "f", fn, "blake3"))
    return v


COLD_SUBSET = (
    "cp+sync",
    "cp+fsync",
    "loop 8M blake3",
    "cfr || hash src thread",
    "loop 8M blake3 +dontneed behind",
    "pipeline 8M blake3 +dontneed behind",
    "mirrord copier drop_cache=on",
)

# ---------------------------------------------------------------------------------------------
# Measurement plumbing.


@dataclass
class Run:
    """One timed copy."""

    seconds: float
    cpu_seconds: float
    cached_delta: int
    ok: bool


@dataclass
class Series:
    """All repetitions of one variant in one cache mode."""

    variant: Variant
    runs: list[Run] = field(default_factory=list)


def timed_copy(
    variant: Variant, src: Path, dst: Path, cold: bool, expected: dict[str, str], settle: float = 0.0
) -> Run:
    """Reset the world (no dst, nothing dirty, source cached or not), then time one copy.

    ``settle``: idle seconds before the copy. In a VM with free page reporting (Firecracker,
    virtio-balloon) memory freed by the previous run is handed back to the host after ~2 s and
    costs a host fault per page when reused; waiting makes every run start from that same state,
    which is also the daemon's steady state (checkpoints arrive minutes apart).
    """
    if dst.exists():
        dst.unlink()
    os.sync()
    if cold:
        drop_caches()
    else:
        warm([src])
    time.sleep(settle)
    before = cached_bytes()
    c0 = cpu_seconds_self_and_children()
    t0 = time.perf_counter()
    digest = variant.fn(src, dst)
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds_self_and_children() - c0
    after = cached_bytes()
    ok = dst.stat().st_size == src.stat().st_size
    if variant.algo is not None:
        ok = ok and digest == expected[variant.algo]
    return Run(seconds, cpu, after - before, ok)


def run_paired(
    variants: list[Variant],
    src: Path,
    dst: Path,
    reps: int,
    cold: bool,
    expected: dict[str, str],
    log: Callable[[str], None],
    settle: float = 0.0,
) -> list[Series]:
    """Every repetition runs every variant once, rotating the order so no variant always follows
    the same neighbour (writeback and page reclaim from the previous run leak into the next)."""
    series = [Series(v) for v in variants]
    for rep in range(reps):
        k = rep % len(series)
        for s in series[k:] + series[:k]:
            r = timed_copy(s.variant, src, dst, cold, expected, settle)
            s.runs.append(r)
            log(
                f"  rep {rep + 1}/{reps} {'cold' if cold else 'warm'} {s.variant.name:34s} "
                f"{r.seconds:6.2f}s cpu {r.cpu_seconds:5.2f}s cached {r.cached_delta / MiB:+8.0f} MiB"
                f"{'' if r.ok else '  DIGEST/SIZE MISMATCH'}"
            )
    if dst.exists():
        dst.unlink()
    return series


def summarize(series: list[Series], size: int) -> list[dict[str, Any]]:
    """Medians, and per-repetition ratios to the baseline of the same repetition."""
    base = series[0].runs
    rows = []
    for s in series:
        ratios = [r.seconds / b.seconds for r, b in zip(s.runs, base, strict=True)]
        med = statistics.median(r.seconds for r in s.runs)
        rows.append(
            {
                "variant": s.variant.name,
                "group": s.variant.group,
                "hash": s.variant.algo,
                "median_s": round(med, 3),
                "min_s": round(min(r.seconds for r in s.runs), 3),
                "max_s": round(max(r.seconds for r in s.runs), 3),
                "median_ratio_to_cp_sync": round(statistics.median(ratios), 3),
                "ratios": [round(x, 3) for x in ratios],
                "gb_per_s": round(size / med / GB, 3),
                "cpu_s_per_gb": round(statistics.median(r.cpu_seconds for r in s.runs) / (size / GB), 3),
                "cached_delta_mib": round(statistics.median(r.cached_delta for r in s.runs) / MiB),
                "all_ok": all(r.ok for r in s.runs),
                "runs_s": [round(r.seconds, 3) for r in s.runs],
            }
        )
    return rows


def hash_speeds(src: Path, seconds: float = 1.0) -> dict[str, dict[str, float]]:
    """Hash throughput: from a buffer in memory, and streaming the (cached) file with readinto."""
    warm([src])
    with open(src, "rb") as fh:
        data = fh.read(256 * MiB)
    view = memoryview(data)
    out: dict[str, dict[str, float]] = {}
    for algo, factory in HASHERS.items():
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            h = factory()
            for i in range(0, len(view), 8 * MiB):
                h.update(view[i : i + 8 * MiB])
            h.hexdigest()
            n += len(view)
        mem = n / (time.perf_counter() - t0) / GB
        fd = os.open(src, os.O_RDONLY)
        t0 = time.perf_counter()
        _hash_fd(fd, algo)
        filegb = src.stat().st_size / (time.perf_counter() - t0) / GB
        os.close(fd)
        out[algo] = {"memory_gb_s": round(mem, 2), "file_page_cache_gb_s": round(filegb, 2)}
    return out


def reference_digests(src: Path) -> dict[str, str]:
    """Digests of the source, to check every hashing variant produced the right one."""
    out = {}
    for algo in HASHERS:
        fd = os.open(src, os.O_RDONLY)
        out[algo] = _hash_fd(fd, algo)
        os.close(fd)
    return out


def to_markdown(doc: dict[str, Any]) -> str:
    """The human-readable table of the same results."""
    m = doc["meta"]
    lines = [
        "# Copy strategies (bench/copy_strategies.py)",
        "",
        f"- File: {m['file_bytes'] / GiB:.2f} GiB, {m['file_kind']}",
        f"- Disk: {m['disk']} (source and destination directories on it)",
        f"- Machine: {m['cpus']} CPUs, {m['kernel']}, Python {m['python']}; {m['reps']} paired repetitions, "
        "medians; order rotated each repetition",
        "- Every variant ends with fsync of the file and of its directory (or `sync`).",
        "- GB = 1e9 bytes. Ratio = median over repetitions of (variant time / cp+sync time in the same repetition).",
        "",
        "## Raw hash speed",
        "",
        "| hash | from memory GB/s | streaming cached file (8 MiB readinto) GB/s |",
        "|---|---:|---:|",
    ]
    for algo, r in doc["hash_speed"].items():
        lines.append(f"| {algo} | {r['memory_gb_s']} | {r['file_page_cache_gb_s']} |")
    for mode, rows in doc["modes"].items():
        desc = {
            "warm": "source in page cache before each run (like a checkpoint the trainer just wrote)",
            "cold": "page cache dropped before each run (echo 3 > /proc/sys/vm/drop_caches)",
        }[mode]
        lines += [
            "",
            f"## {mode}: {desc}",
            "",
            "| group | variant | median s | ratio to cp+sync | GB/s | CPU s/GB | Cached delta MiB | ok |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['group']} | {r['variant']} | {r['median_s']:.2f} | {r['median_ratio_to_cp_sync']:.2f} | "
                f"{r['gb_per_s']:.2f} | {r['cpu_s_per_gb']:.2f} | {r['cached_delta_mib']:+d} | "
                f"{'yes' if r['all_ok'] else 'NO'} |"
            )
    lines += ["", "Cached delta: /proc/meminfo Cached after the copy minus before it (median).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print progress, write results JSON and markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--size", default="2G", help="checkpoint size, e.g. 2G, 256M (default 2G)")
    p.add_argument("--reps", type=int, default=3, help="paired repetitions (default 3)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mirrord-bench")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where to write copy_strategies.{json,md}")
    p.add_argument("--matrix", action="store_true", help="every buffer size with every hash")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="idle seconds before each timed copy, so memory freed by the previous run has gone "
        "back to a VM host (free page reporting) before the next; default 0",
    )
    p.add_argument("--only", default="", help="comma-separated variant names to run (baseline always)")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    srcdir, dstdir = args.workdir / "src", args.workdir / "dst"
    srcdir.mkdir(parents=True, exist_ok=True)
    dstdir.mkdir(parents=True, exist_ok=True)
    src = srcdir / "step_0810.pt"
    dst = dstdir / "step_0810.pt"
    kind_file = srcdir / "kind.txt"
    if not src.exists() or abs(src.stat().st_size - size) > 4 * MiB or not kind_file.exists():
        log(f"making {size / GiB:.2f} GiB checkpoint at {src}")
        t0 = time.perf_counter()
        kind_file.write_text(make_checkpoint(src, size, seed=810))
        log(f"  made in {time.perf_counter() - t0:.1f}s")
    size = src.stat().st_size

    variants = build_variants(args.matrix)
    if args.only:
        wanted = {s.strip() for s in args.only.split(",")}
        variants = [v for v in variants if v.name in wanted or v.name == "cp+sync"]
    log("hash speed")
    speeds = hash_speeds(src)
    log(json.dumps(speeds))
    expected = reference_digests(src)
    doc: dict[str, Any] = {
        "meta": {
            "file_bytes": size,
            "file_kind": kind_file.read_text(),
            "disk": device_of(args.workdir),
            "workdir": "<tempdir>/mirrord-bench" if args.workdir == p.get_default("workdir") else "custom",
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "reps": args.reps,
            "settle_s": args.settle,
            "blake3": getattr(blake3, "__version__", "?"),
            "xxhash": xxhash.VERSION,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "hash_speed": speeds,
        "modes": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "copy_strategies.json").write_text(json.dumps(doc, indent=2) + "\n")
        (args.out / "copy_strategies.md").write_text(to_markdown(doc))

    modes = [("warm", False, variants)]
    if not args.no_cold:
        if os.geteuid() == 0:
            modes.append(("cold", True, [v for v in variants if v.name in COLD_SUBSET]))
        else:
            log("not root: skipping cold-cache runs")
    for mode, cold, vs in modes:
        log(f"{mode}: {len(vs)} variants x {args.reps} reps")
        rows = summarize(run_paired(vs, src, dst, args.reps, cold, expected, log, args.settle), size)
        doc["modes"][mode] = rows
        doc["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save()
        for r in sorted(rows, key=lambda r: r["median_s"]):
            log(
                f"  {r['variant']:34s} {r['median_s']:6.2f}s  x{r['median_ratio_to_cp_sync']:.2f}  "
                f"{r['gb_per_s']:.2f} GB/s  cpu {r['cpu_s_per_gb']:.2f} s/GB  cached {r['cached_delta_mib']:+d} MiB"
            )
    log(f"wrote {args.out / 'copy_strategies.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
