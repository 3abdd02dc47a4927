"""Shared plumbing for the benchmark suite: test data, page-cache control, paired timing, result files."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mirrord.errors import ManifestError
from mirrord.store.manifest import MANIFEST_NAME, Manifest

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9

Log = Callable[[str], None]


def log(msg: str) -> None:
    """Progress on stdout, flushed (runs are long; show where they are)."""
    print(msg, flush=True)


# --- the machine -------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, rest = line.split(":", 1)
            out[key] = int(rest.split()[0]) * 1024
    return out


def cached_bytes() -> int:
    return meminfo()["Cached"]


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """Empty the page cache (root only) so the next read comes from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm(paths: Iterable[Path]) -> None:
    """Read files into the page cache: a checkpoint the trainer just wrote is cached."""
    buf = bytearray(8 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def resident_bytes(paths: Sequence[Path]) -> int | None:
    """Bytes of these files in the page cache (util-linux fincore), or None without fincore."""
    if shutil.which("fincore") is None:
        return None
    total = 0
    for i in range(0, len(paths), 200):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths[i : i + 200])],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        total += sum(int(x) for x in out.split())
    return total


def device_of(path: Path) -> str:
    """Block device, mount point and filesystem that hold ``path``."""
    best = ("", "", "")
    real = str(path.resolve())
    with open("/proc/mounts") as fh:
        for line in fh:
            dev, mnt, fs = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fs)
    return f"{best[0]} on {best[1]} ({best[2]})"


def cpu_seconds_self_and_children() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def proc_cpu_seconds(pid: int, children: bool = False) -> float:
    """utime + stime of a process, from /proc/PID/stat (`children`: of its children it waited for instead)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    first = 13 if children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


# --- test data ---------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'2G', '512M', '4096' -> bytes (binary units)."""
    units = {"K": KiB, "M": MiB, "G": GiB}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def random_tensors(gen: Any, elements: int, prefix: str) -> dict[str, Any]:
    """``elements`` random float32 values from the torch generator ``gen``, as tensors of at most
    64 MiB named ``{prefix}0.weight``, ``{prefix}1.weight``, ... (none when ``elements`` <= 0)."""
    import torch

    state: dict[str, Any] = {}
    left = elements
    i = 0
    while left > 0:
        n = min(16 * MiB, left)
        state[f"{prefix}{i}.weight"] = torch.randn(n, generator=gen)
        left -= n
        i += 1
    return state


def make_checkpoint(path: Path, size: int, seed: int) -> str:
    """A real torch.save file of random float32 tensors (<= 64 MiB each) of about ``size`` bytes;
    random bytes when torch is not importable. Returns what was made."""
    try:
        import torch
    except ImportError:
        with open(path, "wb") as fh:
            left = size
            while left > 0:
                fh.write(os.urandom(min(left, 64 * MiB)))
                left -= 64 * MiB
        return "random bytes (torch not importable)"
    state = random_tensors(torch.Generator().manual_seed(seed), max(1, size // 4), "layer")
    state["step"] = seed
    torch.save(state, path)
    return f"torch.save of random float32 tensors (torch {torch.__version__})"


@dataclass(frozen=True)
class Dataset:
    """``count`` checkpoints of ``size`` bytes, spread over ``runs`` run folders."""

    name: str
    count: int
    size: int
    runs: int = 1

    def files(self, root: Path) -> list[Path]:
        return sorted(p for p in root.rglob("*.pt") if p.is_file())


def ensure_dataset(ds: Dataset, root: Path, say: Log = log) -> tuple[Path, str]:
    """Create (or reuse, if already complete) the dataset under ``root/<name>``."""
    where = root / ds.name
    marker = where / ".complete"
    if marker.exists():
        return where, marker.read_text()
    if where.exists():
        shutil.rmtree(where)
    say(f"making dataset {ds.name}: {ds.count} x {ds.size / MiB:g} MiB")
    t0 = time.perf_counter()
    kind = ""
    for i in range(ds.count):
        run = where / f"run_{i % ds.runs:02d}" if ds.runs > 1 else where
        run.mkdir(parents=True, exist_ok=True)
        kind = make_checkpoint(run / f"step_{i:05d}.pt", ds.size, seed=i + 1)
    marker.write_text(kind)
    say(f"  made in {time.perf_counter() - t0:.1f} s")
    return where, kind


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.pt") if p.is_file())


# --- paired timing -----------------------------------------------------------------------------


@dataclass
class Sample:
    seconds: float
    cpu_seconds: float
    cached_delta: int


@dataclass
class Case:
    """One thing to time: ``run`` does the work; ``check`` (optional) validates the result."""

    name: str
    run: Callable[[], None]
    check: Callable[[], None] | None = None
    samples: list[Sample] = field(default_factory=list)


def run_paired(cases: list[Case], reset: Callable[[], None], reps: int, say: Log = log, label: str = "") -> None:
    """Every repetition runs every case once, in an order rotated per repetition, so slow drift
    of the machine (writeback, reclaim, neighbours) spreads over all cases; ``reset`` runs
    untimed before each case."""
    for rep in range(reps):
        k = rep % len(cases)
        for case in cases[k:] + cases[:k]:
            reset()
            before = cached_bytes()
            c0 = cpu_seconds_self_and_children()
            t0 = time.perf_counter()
            case.run()
            seconds = time.perf_counter() - t0
            cpu = cpu_seconds_self_and_children() - c0
            delta = cached_bytes() - before
            if case.check is not None:
                case.check()
            case.samples.append(Sample(seconds, cpu, delta))
            say(
                f"  {label} rep {rep + 1}/{reps} {case.name:28s} {seconds:7.3f} s  cpu {cpu:6.2f} s  "
                f"cache {delta / MiB:+7.0f} MiB"
            )


def summarize(cases: list[Case], nbytes: int, baseline: str) -> list[dict[str, Any]]:
    """Medians; ratios are taken per repetition against the baseline of the same repetition."""
    base = next(c for c in cases if c.name == baseline).samples
    rows = []
    for c in cases:
        ratios = [s.seconds / b.seconds for s, b in zip(c.samples, base, strict=True)]
        med = statistics.median(s.seconds for s in c.samples)
        rows.append(
            {
                "case": c.name,
                "median_s": round(med, 3),
                "min_s": round(min(s.seconds for s in c.samples), 3),
                "ratio": round(statistics.median(ratios), 3),
                "ratios": [round(r, 3) for r in ratios],
                "gb_per_s": round(nbytes / med / GB, 3),
                "cpu_s_per_gb": round(statistics.median(s.cpu_seconds for s in c.samples) / (nbytes / GB), 3),
                "cache_delta_mib": round(statistics.median(s.cached_delta for s in c.samples) / MiB),
                "runs_s": [round(s.seconds, 3) for s in c.samples],
            }
        )
    return rows


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


# --- watching a mirror ------------------------------------------------------------------------

MANIFEST_PREFIX = MANIFEST_NAME.removesuffix(".json")


class ManifestWatcher:
    """Reads the mirror's manifest (snapshot + journal) only when one of its files changed (cheap enough
    to poll every ms)."""

    def __init__(self, mirror: Path) -> None:
        self.mirror = mirror
        self._key: tuple[tuple[str, int, int, int], ...] | None = None
        self.entries: dict[str, Any] = {}

    def refresh(self) -> dict[str, Any]:
        key = []
        try:
            names = sorted(p.name for p in self.mirror.iterdir())
        except FileNotFoundError:
            return self.entries
        for name in names:
            if name.startswith(MANIFEST_PREFIX) and not name.endswith(".part"):
                try:
                    st = (self.mirror / name).stat()
                except FileNotFoundError:
                    continue
                key.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        if tuple(key) != self._key:
            try:
                self.entries = Manifest.load(self.mirror).entries
            except ManifestError:  # changed under us by a compaction: read again at the next poll
                return self.entries
            self._key = tuple(key)
        return self.entries


# --- results -----------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    rows = [list(r) for r in rows]
    align = ["---:" if rows and isinstance(rows[0][i], int | float) else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(v) for v in r) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# --- the machine's load during a measurement ---------------------------------------------------


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages (/proc/loadavg)."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)


_SHIELD: list[str] = []  # the cgroup this process joined with shield_cpu(), if it did


def shield_cpu(name: str = "mirrord-bench") -> str:
    """Join a CPU cgroup weighted far above everything else on the machine (cgroup v1 cpu.shares 262144,
    v2 cpu.weight 10000); children inherit it. On a machine shared with other work a measurement then
    sees the CPU as on a quiet one (the disk and the memory bus stay shared): the neighbours wait while
    it runs. Inside, nice and SCHED_IDLE rank as usual, so the daemon's throttling is still measured.
    Needs root; returns the cgroup's path, raises OSError naming it otherwise."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.shares").exists():
        group, knob, value = v1 / name, "cpu.shares", "262144"
    elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
            (v2 / "cgroup.subtree_control").write_text("+cpu")
        group, knob, value = v2 / name, "cpu.weight", "10000"
    else:
        raise OSError(f"no cgroup CPU controller under {v2}: cannot shield the measurement")
    group.mkdir(exist_ok=True)
    (group / knob).write_text(value)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    _SHIELD[:] = [str(group)]
    return str(group)


class LoadSampler:
    """Samples the 1-minute load average every `interval` seconds while a measurement runs (a thread),
    so each figure can be published next to how busy the machine was; on a shared machine the
    absolute times follow the neighbours, the paired ratios much less."""

    def __init__(self, interval: float = 1.0) -> None:
        import threading

        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(load_average()[0])
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(load_average()[0])

    def summary(self) -> dict[str, float]:
        s = self.samples or [load_average()[0]]
        return {
            "load_min": min(s),
            "load_max": max(s),
            "load_mean": round(statistics.mean(s), 2),
            "cpu_shielded": bool(_SHIELD),
        }

    def text(self) -> str:
        d = self.summary()
        return f"{d['load_min']:.1f}-{d['load_max']:.1f}" + (" (CPU shielded)" if d["cpu_shielded"] else "")
