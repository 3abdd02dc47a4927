"""Manifest: what recording one copy costs at 1,000 / 10,000 / 100,000 entries, before and after the journal.

    python -m bench.manifest [--workdir DIR] [--out DIR] [--smoke]

* **before**: the manifest of mirrord 0.1.0 (read from git at BASELINE), which rewrote and republished
  the whole JSON (temp, fsync, rename, fsync dir) on every change, under the lock;
* **after**: one journal append and one fsync per change, whatever the size; plus, measured apart,
  the compaction that folds the journal into a new snapshot every max(1000, N/4) records (outside
  the lock: appends go on meanwhile) and its share per record; and what a reader pays to load the
  manifest (snapshot alone, and with the longest journal a compaction lets build up);
* **group commit**: T threads recording at once (copies that finish together): journal fsyncs per
  record and records per second;
* **many small files**: `mirrord sync` of 200 x 4 MiB (10 run folders), this tree vs BASELINE vs
  `cp -r` + `sync`, paired and interleaved, and the fsync calls each makes (strace -f -c).

Every timing is one durable change on the disk under --workdir (fsync included). Results go to
bench/results/manifest.{md,json} (smoke: WORKDIR/smoke).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import device_of, log, md_table, write_json
from mirrord.core.model import ManifestEntry
from mirrord.store import atomic
from mirrord.store.journal import frame
from mirrord.store.manifest import COMPACT_MIN_RECORDS, MANIFEST_NAME, Change, Manifest, encode_snapshot

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "c9550a2"  # main just before the journal: its manifest rewrote the whole file per change


def entry(i: int, run: int = 1000) -> ManifestEntry:
    return ManifestEntry(
        f"run_{i % run:04d}/step_{i // run:06d}.pt",
        2_652_347_904 + i,
        "blake3",
        f"{i:064x}",
        1_764_480_000_123_456_789 + i,
        i // run,
        1_764_480_012.5 + i,
    )


def entries_of(n: int) -> dict[str, ManifestEntry]:
    return {e.path: e for e in map(entry, range(n))}


def fresh_dir(work: Path, label: str) -> Path:
    d = work / label
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
        "max_ms": round(ms[-1], 3),
        "samples": len(ms),
    }


def old_manifest_module() -> types.ModuleType | None:
    """mirrord/store/manifest.py as it was at BASELINE, imported under another name (its imports still resolve)."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{BASELINE}:mirrord/store/manifest.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("mirrord_manifest_baseline")
    exec(compile(source, f"{BASELINE}:mirrord/store/manifest.py", "exec"), module.__dict__)  # noqa: S102
    return module


def settle() -> None:
    """Nothing dirty left from building the case (an fsync would pay for writing it back), no garbage."""
    os.sync()
    gc.collect()


def time_records(record: Callable[[ManifestEntry], None], start: int, count: int) -> list[float]:
    times = []
    for i in range(start, start + count):
        t0 = time.perf_counter()
        record(entry(i))
        times.append(time.perf_counter() - t0)
    return times


def measure_before(work: Path, n: int, count: int) -> dict[str, Any] | None:
    old = old_manifest_module()
    if old is None:
        return None
    d = fresh_dir(work, f"before-{n}")
    path = d / MANIFEST_NAME
    manifest = old.Manifest(entries_of(n)).bind(lambda data: atomic.write_bytes_atomic(path, data))
    settle()
    return summary(time_records(manifest.record, n, count))


def measure_after(work: Path, n: int, count: int) -> dict[str, Any]:
    d = fresh_dir(work, f"after-{n}")
    (d / MANIFEST_NAME).write_bytes(encode_snapshot(entries_of(n)))
    manifest = Manifest.open(d)
    settle()
    record = summary(time_records(manifest.record, n, count))
    threshold = max(COMPACT_MIN_RECORDS, len(manifest) // 4)
    t0 = time.perf_counter()
    manifest.compact()
    compaction = time.perf_counter() - t0
    manifest.close()
    t0 = time.perf_counter()
    Manifest.load(d)
    load_snapshot = time.perf_counter() - t0
    # The longest journal a reader can meet: `threshold` records (written without fsync: only reading counts).
    journal = sorted(d.glob(".mirrord-manifest.journal.*"))[-1]
    with journal.open("ab") as f:
        for i in range(threshold):
            f.write(frame(Change(puts=(entry(n + count + i),)).encode()))
    t0 = time.perf_counter()
    Manifest.load(d)
    load_full = time.perf_counter() - t0
    return {
        **record,
        "compaction_s": round(compaction, 3),
        "compaction_every_records": threshold,
        "amortized_ms": round(record["median_ms"] + compaction * 1000 / threshold, 3),
        "load_snapshot_s": round(load_snapshot, 3),
        "load_with_longest_journal_s": round(load_full, 3),
        "snapshot_mib": round((d / MANIFEST_NAME).stat().st_size / 2**20, 2),
    }


def measure_group(work: Path, n: int, threads: int, per_thread: int) -> dict[str, Any]:
    """T threads record at once; journal fsyncs counted by wrapping os.fsync in this process."""
    d = fresh_dir(work, f"group-{threads}")
    (d / MANIFEST_NAME).write_bytes(encode_snapshot(entries_of(n)))
    manifest = Manifest.open(d)
    manifest.record(entry(n))  # the journal exists: only appends are counted
    real = os.fsync
    synced = [0]

    def fsync(fd: int) -> None:
        if ".journal." in str(Path(f"/proc/self/fd/{fd}").readlink()):
            synced[0] += 1
        real(fd)

    def work_(t: int) -> None:
        for i in range(per_thread):
            manifest.record(entry(n + 1 + t * per_thread + i))

    os.fsync = fsync  # type: ignore[assignment]
    try:
        pool = [threading.Thread(target=work_, args=(t,)) for t in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - t0
    finally:
        os.fsync = real
    total = threads * per_thread
    manifest.close()
    return {
        "threads": threads,
        "records": total,
        "journal_fsyncs": synced[0],
        "fsyncs_per_record": round(synced[0] / total, 3),
        "records_per_s": round(total / elapsed),
    }


def baseline_tree(work: Path) -> Path | None:
    """The mirrord package as of BASELINE, unpacked from git (pure Python: it runs on this venv)."""
    where = work / f"mirrord-{BASELINE}"
    if (where / "mirrord" / "__main__.py").exists():
        return where
    where.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BASELINE, "mirrord"], capture_output=True)
    if archive.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def sync_cmd(src: Path, dst: Path, code: Path) -> list[str]:
    return [
        sys.executable,
        "-c",
        f"import sys; sys.path.insert(0, {str(code)!r}); from mirrord.cli import main; sys.exit(main())",
        "sync",
        "--primary",
        str(src),
        "--mirror",
        str(dst),
    ]


def fsyncs_of(cmd: list[str], env: dict[str, str]) -> int | None:
    """fsync + fdatasync + syncfs calls of one run (strace -f -c), or None without strace. (A group of
    small copies is made durable by one syncfs: it counts as one, like an fsync.)"""
    if shutil.which("strace") is None:
        return None
    out = subprocess.run(
        ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync,syncfs", "--", *cmd],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    return sum(
        int(line.split()[3])
        for line in out.splitlines()
        if line.split()[-1:] in (["fsync"], ["fdatasync"], ["syncfs"]) and line.split()[3].isdigit()
    )


def measure_small_files(work: Path, count: int, size: int, reps: int) -> dict[str, Any] | None:
    from bench.common import Case, Dataset, ensure_dataset, run_paired, summarize, warm
    from bench.throughput import mirrord_env

    baseline = baseline_tree(work)
    ds = Dataset(f"{count}x{size >> 20}MiB", count, size, runs=10)
    src, _ = ensure_dataset(ds, work / "data")
    dst = work / "small-mirror"
    files = ds.files(src)
    env = mirrord_env(copy__settle_seconds="0", log__format="json", prune__enabled="false")  # copy all 200

    def reset() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        os.sync()
        warm(files)

    def run(cmd: list[str]) -> Callable[[], None]:
        return lambda: subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cp_sync() -> None:
        subprocess.run(["cp", "-r", f"{src}/.", f"{dst}/"], check=True)
        subprocess.run(["sync"], check=True)

    cases = [Case("cp+sync", cp_sync), Case("mirrord sync (journal)", run(sync_cmd(src, dst, REPO)))]
    if baseline is not None:
        cases.append(Case(f"mirrord sync ({BASELINE})", run(sync_cmd(src, dst, baseline))))
    run_paired(cases, reset, reps, label=ds.name)
    rows = summarize(cases, sum(f.stat().st_size for f in files), "cp+sync")
    for row, code in zip(rows[1:], [REPO, baseline], strict=False):
        reset()
        n = fsyncs_of(sync_cmd(src, dst, code), env) if code is not None else None
        row["fsyncs"] = n
        row["fsyncs_per_file"] = None if n is None else round(n / count, 2)
    shutil.rmtree(dst, ignore_errors=True)
    return {"dataset": ds.name, "files": count, "rows": rows}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def to_markdown(doc: dict[str, Any]) -> str:
    m = doc["meta"]
    out = [
        "# Manifest: recording one copy" + (" (smoke run)" if m["smoke"] else ""),
        "",
        f"`{m['command']}` on {m['cpus']} CPUs, disk {m['disk']}; load average before/after: "
        f"{m['load_before']} / {m['load_after']}. Each record is durable when timed (fsync included).",
        "",
        "## One change (record one copy)",
        "",
        md_table(
            [
                "entries",
                "before: median ms",
                "before: max ms",
                "after: median ms",
                "after: p99 ms",
                "after: max ms",
                "compaction s (every N records)",
                "after: amortized ms",
                "speed-up (median)",
            ],
            [
                [
                    r["entries"],
                    r["before"]["median_ms"] if r["before"] else "-",
                    r["before"]["max_ms"] if r["before"] else "-",
                    r["after"]["median_ms"],
                    r["after"]["p99_ms"],
                    r["after"]["max_ms"],
                    f"{r['after']['compaction_s']} ({r['after']['compaction_every_records']})",
                    r["after"]["amortized_ms"],
                    f"{r['before']['median_ms'] / r['after']['median_ms']:.0f}x" if r["before"] else "-",
                ]
                for r in doc["sizes"]
            ],
        ),
        "",
        "## Loading (what `latest`, `verify`, `status` and a restart pay)",
        "",
        md_table(
            ["entries", "snapshot MiB", "load, snapshot only s", "load with the longest journal s"],
            [
                [
                    r["entries"],
                    r["after"]["snapshot_mib"],
                    r["after"]["load_snapshot_s"],
                    r["after"]["load_with_longest_journal_s"],
                ]
                for r in doc["sizes"]
            ],
        ),
        "",
        f"## Group commit: threads recording at once ({doc['group_entries']} entries)",
        "",
        md_table(
            ["threads", "records", "journal fsyncs", "fsyncs per record", "records/s"],
            [
                [g["threads"], g["records"], g["journal_fsyncs"], g["fsyncs_per_record"], g["records_per_s"]]
                for g in doc["group"]
            ],
        ),
        "",
    ]
    small = doc.get("small_files")
    if small:
        out += [
            f"## Many small files: `mirrord sync` of {small['dataset']} (10 run folders), paired",
            "",
            md_table(
                ["case", "median s", "ratio to cp+sync", "runs s", "fsyncs", "fsyncs per file"],
                [
                    [
                        r["case"],
                        r["median_s"],
                        r["ratio"],
                        " ".join(f"{x:.2f}" for x in r["runs_s"]),
                        r.get("fsyncs", "-"),
                        r.get("fsyncs_per_file", "-"),
                    ]
                    for r in small["rows"]
                ],
            ),
            "",
        ]
    return "\n".join(out)


def measure(work: Path, smoke: bool, command: str = "python -m bench.manifest") -> dict[str, Any]:
    """Every measurement of this module, as one document (also a section of `python -m bench`)."""
    work.mkdir(parents=True, exist_ok=True)
    sizes = [(1000, 5, 50)] if smoke else [(1000, 50, 500), (10_000, 20, 500), (100_000, 5, 500)]
    doc: dict[str, Any] = {
        "meta": {
            "command": command,
            "smoke": smoke,
            "cpus": os.cpu_count(),
            "disk": device_of(work),
            "baseline": BASELINE,
            "load_before": load_average(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "sizes": [],
        "group": [],
    }
    for n, before_count, after_count in sizes:
        log(f"manifest: {n} entries")
        doc["sizes"].append(
            {
                "entries": n,
                "before": measure_before(work, n, before_count),
                "after": measure_after(work, n, after_count),
            }
        )
        log(f"  {doc['sizes'][-1]}")
    doc["group_entries"] = 10_000 if not smoke else 1000
    for threads in (1, 2, 4, 8):
        doc["group"].append(measure_group(work, doc["group_entries"], threads, 100 if not smoke else 10))
        log(f"  group: {doc['group'][-1]}")
    log("many small files")
    doc["small_files"] = measure_small_files(work, 20 if smoke else 200, (1 if smoke else 4) << 20, 1 if smoke else 5)
    doc["meta"]["load_after"] = load_average()
    doc["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for leftover in work.iterdir():
        if leftover.name != "data":  # the dataset is kept for the next run
            shutil.rmtree(leftover, ignore_errors=True)
    return doc


def goal_rows(doc: dict[str, Any]) -> list[list[Any]]:
    """The issue's goal: recording one copy at 100,000 entries < 10 ms."""
    rows = []
    for r in doc.get("sizes", []):
        if r["entries"] == 100_000:
            a = r["after"]
            rows.append(
                [
                    "manifest: recording one copy at 100,000 entries < 10 ms",
                    f"median {a['median_ms']} ms, p99 {a['p99_ms']} ms (was {r['before']['median_ms']} ms)"
                    if r["before"]
                    else f"median {a['median_ms']} ms, p99 {a['p99_ms']} ms",
                    "yes" if a["median_ms"] < 10 else "no",
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.manifest", description=__doc__.split("\n", 1)[0])
    p.add_argument("--smoke", action="store_true", help="1,000 entries only, few samples")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mirrord-bench")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    work = args.workdir / ("smoke" if args.smoke else "full") / "manifest"
    out = args.out or (args.workdir / "smoke" / "results" if args.smoke else RESULTS)
    doc = measure(work, args.smoke, "python -m bench.manifest " + " ".join(argv if argv is not None else sys.argv[1:]))
    write_json(out / "manifest.json", doc)
    (out / "manifest.md").write_text(to_markdown(doc))
    log(f"results: {out / 'manifest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
