"""The benchmark suite: `python -m bench` (every budget of issue 31 in one table, bench/goals.py, ~30 min)
or `python -m bench --smoke` (the same at tiny sizes, < 1 min; .ci/run runs it).

`--goals` picks goals (sync, trainer, answers, scale, small, commit); results go to
bench/results/goals.{md,json}. The earlier sections (throughput with rsync/rclone/shutil baselines and
copy.workers 1/2/4, latency of 1 MiB commits, resources, scale, manifest) run with `--only SECTIONS`
and write bench/results/bench.{json,md}. A smoke run writes to its work directory unless --out is
given, so it never overwrites the committed results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import goals as goals_bench
from bench import latency, resources, scale, throughput
from bench import manifest as manifest_bench
from bench.common import GB, Dataset, GiB, KiB, MiB, device_of, log, md_table, shield_cpu, write_json

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("throughput", "latency", "resources", "scale", "manifest")


def profile(smoke: bool) -> dict[str, Any]:
    """Sizes for a full run and for the smoke run."""
    if smoke:
        return {
            "datasets": [
                Dataset("1x8MiB", 1, 8 * MiB),
                Dataset("4x2MiB", 4, 2 * MiB),
                Dataset("20x256KiB", 20, 256 * KiB, runs=4),
            ],
            "reps": 1,
            "latency": {"native": 3, "polling": 1},
            "latency_bytes": 64 * KiB,
            "latency_settings": {"copy": {"settle_seconds": 0.5}, "watch": {"poll_interval_seconds": 0.2}},
            "copies": 1,
            "idle_seconds": 1.0,
            "drop_modes": (True,),
            "scale": [(1000, 100)],
        }
    return {
        "datasets": [
            Dataset("1x2GiB", 1, 2 * GiB),
            Dataset("8x256MiB", 8, 256 * MiB),
            Dataset("200x4MiB", 200, 4 * MiB, runs=10),
        ],
        "reps": 3,
        "latency": {"native": 60, "polling": 50},
        "latency_bytes": 1 * MiB,
        "latency_settings": {},
        "copies": 2,
        "idle_seconds": 60.0,
        "drop_modes": (True, False),
        "scale": [(10_000, 1000), (100_000, 1000)],
    }


def extra_cases(ds: Dataset, index: int) -> dict[str, dict[str, str]]:
    """mirrord variants timed next to the tools: drop_cache off on the big file, workers on the middle set."""
    if index == 0:
        return {"mirrord sync drop_cache=off": {"io__drop_cache": "false"}}
    if index == 1:
        return {"mirrord sync workers=1": {"copy__workers": "1"}, "mirrord sync workers=4": {"copy__workers": "4"}}
    return {}


def goals(doc: dict[str, Any]) -> list[list[Any]]:
    """Each goal of the issue with what was measured."""
    rows: list[list[Any]] = []
    tp = doc.get("throughput") or []
    if tp:
        r = next((x for x in tp[0]["rows"] if x["case"] == "mirrord sync"), None)
        if r:
            rows.append(
                [
                    f"throughput: mirrord sync <= 1.10x cp+sync ({tp[0]['dataset']})",
                    f"{r['ratio']:.2f}x",
                    "yes" if r["ratio"] <= 1.10 else "no",
                ]
            )
    for lat in doc.get("latency") or []:
        if lat["mode"] == "native":
            rows.append(
                [
                    "latency: commit-to-mirror p50 < 100 ms (native events)",
                    f"p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms",
                    "yes" if lat["p50_ms"] < 100 else "no",
                ]
            )
    for res in doc.get("resources") or []:
        if res["drop_cache"]:
            rows.append(
                [
                    f"resources: peak RSS < 80 MB while mirroring {res['bytes'] / GB:.1f} GB",
                    f"{res['peak_rss_mib']} MiB",
                    "yes" if res["peak_rss_mib"] * MiB < 80e6 else "no",
                ]
            )
            rows.append(
                [
                    f"resources: idle CPU < 0.5% (over {res['idle_seconds']:.0f} s)",
                    f"{res['idle_cpu_percent']}%",
                    "yes" if res["idle_cpu_percent"] < 0.5 else "no",
                ]
            )
    rows += manifest_bench.goal_rows(doc.get("manifest") or {})
    for sc in doc.get("scale") or []:
        if sc["files"] == 10_000:
            rows.append(
                [
                    "scale: reconcile of 10,000 files < 1 s",
                    f"{sc['reconcile_s']} s",
                    "yes" if sc["reconcile_s"] < 1 else "no",
                ]
            )
    return rows


def to_markdown(doc: dict[str, Any]) -> str:
    m = doc["meta"]
    out = [
        "# mirrord benchmarks" + (" (smoke run: tiny sizes, numbers mean nothing)" if m["smoke"] else ""),
        "",
        f"`{m['command']}` on {m['cpus']} CPUs, Linux {m['kernel']}, Python {m['python']}; disk {m['disk']} "
        "(source and mirror directories on the same disk). Medians of paired repetitions; a ratio is wall "
        "time over `cp`+`sync` in the same repetition (< 1 is faster). GB = 1e9 bytes.",
        "",
    ]
    g = goals(doc)
    if g:
        out += ["## Goals", "", md_table(["goal", "measured", "met"], g), ""]
    if doc.get("mirrord_sync_startup_s") is not None:
        out += [
            f"`mirrord sync` with nothing to copy (interpreter start-up, imports, lock, manifest, scans) takes "
            f"{doc['mirrord_sync_startup_s']} s; every `mirrord sync` row below includes it.",
            "",
        ]
    for t in doc.get("throughput") or []:
        out += [
            f"## Throughput: {t['dataset']} ({t['files']} files, {t['bytes'] / GB:.2f} GB, {t['file_kind']})",
            "",
            md_table(
                ["case", "median s", "ratio to cp+sync", "GB/s", "CPU s/GB", "page cache delta MiB", "runs s"],
                [
                    [
                        r["case"],
                        r["median_s"],
                        r["ratio"],
                        r["gb_per_s"],
                        r["cpu_s_per_gb"],
                        r["cache_delta_mib"],
                        " ".join(f"{x:.2f}" for x in r["runs_s"]),
                    ]
                    for r in t["rows"]
                ],
            ),
            "",
        ]
    if doc.get("latency"):
        out += [
            "## Latency: commit (rename on primary) -> final name + manifest entry on the mirror",
            "",
            md_table(
                ["watch mode", "samples", "checkpoint bytes", "p50 ms", "p99 ms", "min ms", "max ms"],
                [
                    [x["mode"], x["samples"], x["checkpoint_bytes"], x["p50_ms"], x["p99_ms"], x["min_ms"], x["max_ms"]]
                    for x in doc["latency"]
                ],
            ),
            "",
        ]
    if doc.get("resources"):
        out += [
            "## Resources of `mirrord run` while mirroring, and page cache afterwards",
            "",
            md_table(
                [
                    "io.drop_cache",
                    "files",
                    "GB",
                    "GB/s",
                    "idle RSS MiB",
                    "peak RSS MiB",
                    "CPU s/GB",
                    "idle CPU %",
                    "page cache delta MiB",
                    "mirror files cached MiB",
                    "sources cached MiB",
                ],
                [
                    [
                        str(x["drop_cache"]).lower(),
                        x["files"],
                        round(x["bytes"] / GB, 2),
                        x["gb_per_s"],
                        x["idle_rss_mib"],
                        x["peak_rss_mib"],
                        x["cpu_s_per_gb"],
                        x["idle_cpu_percent"],
                        x["cache_delta_mib"],
                        x["mirror_resident_mib"],
                        x["source_resident_mib"],
                    ]
                    for x in doc["resources"]
                ],
            ),
            "",
        ]
    if doc.get("scale"):
        out += [
            "## Scale: reconcile (scan both sides + load manifest + plan), in-sync trees",
            "",
            md_table(
                [
                    "files",
                    "run folders",
                    "scan primary s",
                    "scan mirror s",
                    "manifest load s",
                    "plan s",
                    "reconcile s",
                    "peak RSS growth MiB",
                    "plan all-new s",
                    "persist 1 entry s",
                    "manifest MiB",
                    "`mirrord sync` no-op s",
                ],
                [
                    [
                        x["files"],
                        x["runs"],
                        x["scan_primary_s"],
                        x["scan_mirror_s"],
                        x["manifest_load_s"],
                        x["plan_s"],
                        x["reconcile_s"],
                        x["reconcile_peak_rss_growth_mib"],
                        x["plan_all_new_s"],
                        x["manifest_record_s"],
                        x["manifest_mib"],
                        x["sync_command_s"],
                    ]
                    for x in doc["scale"]
                ],
            ),
            "",
        ]
    if doc.get("manifest"):
        out += [
            "## Manifest (full tables: `python -m bench.manifest`, bench/results/manifest.md)",
            "",
            manifest_bench.to_markdown(doc["manifest"]).split("\n", 4)[4],
            "",
        ]
    if m.get("kept_from_previous_run"):
        out += [
            f"Sections {', '.join(m['kept_from_previous_run'])} are from the previous run (this one ran "
            f"`{m['command'].strip()}`).",
            "",
        ]
    out += [f"Started {m['started']}, finished {m.get('finished', '?')}.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n", 1)[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition, < 1 min")
    p.add_argument(
        "--goals",
        default=",".join(goals_bench.GOALS),
        help=f"comma-separated goals of issue 31 ({', '.join(goals_bench.GOALS)}; default all)",
    )
    p.add_argument(
        "--trainer-reps", type=int, help="repetitions of the trainer and scrub goals (default 5 and 3; smoke 1)"
    )
    p.add_argument("--only", help=f"run the earlier sections instead ({', '.join(SECTIONS)}), comma-separated")
    p.add_argument("--reps", type=int, help="paired repetitions for throughput (default 3; smoke 1)")
    p.add_argument("--idle-seconds", type=float, help="idle CPU window (default 60; smoke 1)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "mirrord-bench",
        help="scratch space on the disk under test (default: <tmp>/mirrord-bench; datasets are kept)",
    )
    p.add_argument(
        "--shield",
        action="store_true",
        help="root: run in a cgroup weighted far above the rest of the machine, so that other work's "
        "CPU load does not reach the measurements (recorded next to each load figure)",
    )
    p.add_argument("--out", type=Path, help="results directory (default bench/results; smoke: WORKDIR/smoke)")
    args = p.parse_args(argv)
    if args.only is None:
        return _goals(p, args, argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := set(sections) - set(SECTIONS):
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    prof = profile(args.smoke)
    reps = args.reps or prof["reps"]
    idle = args.idle_seconds if args.idle_seconds is not None else prof["idle_seconds"]
    work = args.workdir / ("smoke" if args.smoke else "full")
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    out = args.out or (work / "results" if args.smoke else RESULTS)
    name = "bench"
    doc: dict[str, Any] = {
        "meta": {
            "command": _shown(argv),
            "smoke": args.smoke,
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "disk": device_of(work),
            "reps": reps,
            "tools": {t: shutil.which(t) is not None for t in ("rsync", "rclone", "fincore")},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    }
    t_start = time.perf_counter()

    def save() -> None:
        doc["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        doc["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_json(out / f"{name}.json", doc)
        (out / f"{name}.md").write_text(to_markdown(doc))

    previous = out / f"{name}.json"
    if set(sections) != set(SECTIONS) and previous.exists():
        # A partial run updates its sections and keeps the others from the last run.
        kept = json.loads(previous.read_text())
        for section in SECTIONS:
            if section not in sections and section in kept:
                doc[section] = kept[section]
                if section == "throughput":
                    doc["mirrord_sync_startup_s"] = kept.get("mirrord_sync_startup_s")
        doc["meta"]["kept_from_previous_run"] = [s for s in SECTIONS if s not in sections and s in kept]
    if "throughput" in sections:
        doc["mirrord_sync_startup_s"] = throughput.startup_seconds(work, reps)
        log(f"mirrord sync with nothing to copy: {doc['mirrord_sync_startup_s']} s")
        doc["throughput"] = []
        for i, ds in enumerate(prof["datasets"]):
            log(f"throughput {ds.name}")
            doc["throughput"].append(throughput.bench_dataset(ds, data, work, reps, not args.smoke, extra_cases(ds, i)))
            save()
    if "latency" in sections:
        doc["latency"] = []
        for mode, n in prof["latency"].items():
            log(f"latency {mode}")
            doc["latency"].append(latency.measure(work, mode, n, prof["latency_bytes"], prof["latency_settings"]))
            save()
    if "resources" in sections:
        from bench.common import ensure_dataset

        sources = [ensure_dataset(ds, data)[0] for ds in prof["datasets"]]
        doc["resources"] = []
        for drop in prof["drop_modes"]:
            log(f"resources drop_cache={drop}")
            doc["resources"].append(resources.measure(work, sources, prof["copies"], drop, idle))
            save()
    if "scale" in sections:
        doc["scale"] = []
        for n_files, n_runs in prof["scale"]:
            log(f"scale {n_files}")
            doc["scale"].append(scale.measure(work, n_files, n_runs))
            save()
    if "manifest" in sections:
        log("manifest")
        doc["manifest"] = manifest_bench.measure(work / "manifest", args.smoke)
    save()
    log(f"wrote {out / (name + '.json')} and .md ({time.perf_counter() - t_start:.1f} s)")
    return 0


def _shown(argv: list[str] | None) -> str:
    """The command as run, with the scratch and results folders named, not spelled (results hold no
    machine paths)."""
    words = list(argv if argv is not None else sys.argv[1:])
    for i, word in enumerate(words):
        for flag in ("--workdir", "--out"):
            if word == flag and i + 1 < len(words):
                words[i + 1] = flag.removeprefix("--").upper()
            elif word.startswith(flag + "="):
                words[i] = f"{flag}={flag.removeprefix('--').upper()}"
    return "python -m bench " + " ".join(words)


def _goals(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> int:
    chosen = [g.strip() for g in args.goals.split(",") if g.strip()]
    if unknown := set(chosen) - set(goals_bench.GOALS):
        p.error(f"unknown goal(s): {', '.join(sorted(unknown))}")
    work = args.workdir / ("smoke" if args.smoke else "full")
    work.mkdir(parents=True, exist_ok=True)
    out = args.out or (work / "results" if args.smoke else RESULTS)
    if args.shield:
        try:
            log(f"CPU shield: {shield_cpu()}")
        except OSError as exc:
            p.error(f"--shield: {exc}")
    meta = {
        "command": _shown(argv),
        "shield": args.shield,
        "smoke": args.smoke,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "disk": device_of(work),
        "tools": {t: shutil.which(t) is not None for t in ("fio", "strace", "dd")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    goals_bench.run_goals(
        list(dict.fromkeys(chosen)), args.smoke, work, out, meta, args.trainer_reps
    )  # in the order asked
    return 0
