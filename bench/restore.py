"""Restore of one big Hugging Face Trainer folder checkpoint (checkpoint-100/: model.safetensors, optimizer.pt,
scheduler.pt, rng_state.pth, trainer_state.json), as an operator on another host types it, with no config
file: `mirrord restore --mirror M --to D` next to `cp -r` (+ sync) from a local mirror, and next to
`aws s3 cp --recursive` (+ sync) and boto3's download_file (+ fsync) from SeaweedFS, in the same run.

    python -m bench.restore [--mib 2048] [--reps 2] [--dir DIR]

The folder is written by tests/support/folders.write_hf (real safetensors and torch.save files), mirrored
first by `mirrord sync` (layout hf) into a local folder and into SeaweedFS. Every case writes a fresh copy
into an empty folder and makes it durable (mirrord fsyncs itself; the other tools are followed by `sync` of
every file). Wall time includes the process start. The mirror's files are in the page cache for every local
case alike. Paired: each repetition runs every case once, in an order rotated per repetition, and a ratio is
taken inside one repetition (local cases over `cp -r`, S3 cases over `aws s3 cp`); medians. Writes
bench/results/restore.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tomli_w

from bench.common import load_average

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results"
UNIT = "run/checkpoint-100"
BOTO3_DOWNLOAD = """
import os, sys, boto3
c = boto3.client("s3", endpoint_url=sys.argv[1])
for page in c.get_paginator("list_objects_v2").paginate(Bucket=sys.argv[2], Prefix=sys.argv[3] + "/"):
    for obj in page.get("Contents", []):
        out = os.path.join(sys.argv[4], obj["Key"][len(sys.argv[3]) + 1 :])
        c.download_file(sys.argv[2], obj["Key"], out)
        fd = os.open(out, os.O_RDONLY); os.fsync(fd); os.close(fd)
"""
SYNC_FOLDER = 'cd "$1"/checkpoint-100 && sync * .'  # every file of the copy, and its folder


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    from tests.s3.seaweed import running_seaweed
    from tests.support.folders import write_hf

    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mirrord-bench-restore-", dir=args.dir))
    mirrord = [sys.executable, "-m", "mirrord"]
    try:
        primary, mirror = work / "primary", work / "mirror"
        write_hf(primary / UNIT, 100, width=int(math.sqrt(args.mib * MiB / 12)))  # weights + AdamW's two moments
        size = sum(p.stat().st_size for p in (primary / UNIT).iterdir())
        base = {"primary": str(primary), "layout": "hf", "prune": {"enabled": False}}
        local = work / "local.toml"
        local.write_text(tomli_w.dumps({**base, "mirror": str(mirror)}))
        subprocess.run([*mirrord, "sync", "--config", str(local)], check=True, capture_output=True)
        times: dict[str, list[float]] = {}
        loads: list[float] = []
        with running_seaweed(work / "weed") as weed:
            env = {**os.environ, **weed.env()}
            import boto3

            boto3.client("s3", endpoint_url=weed.endpoint, **_keys(env)).create_bucket(Bucket="bench")
            remote = work / "s3.toml"
            s3 = {"endpoint_url": weed.endpoint, "addressing_style": "path"}
            remote.write_text(tomli_w.dumps({**base, "mirror": "s3://bench/m", "s3": s3}))
            subprocess.run([*mirrord, "sync", "--config", str(remote)], check=True, capture_output=True, env=env)
            no_config = {**env, "AWS_ENDPOINT_URL": weed.endpoint}
            source = mirror / UNIT
            cases: dict[str, Callable[[Path], float]] = {
                "cp -r + sync (local)": lambda d: timed(
                    ["sh", "-c", f'cp -r {source} "$1"/ && {SYNC_FOLDER}', "-", str(d)]
                ),
                "mirrord restore (local)": lambda d: timed(
                    [*mirrord, "restore", "--mirror", str(mirror), "--to", str(d)]
                ),
                "aws s3 cp --recursive + sync (S3)": lambda d: timed(
                    [
                        "sh",
                        "-c",
                        f"aws --endpoint-url {weed.endpoint} s3 cp --recursive --quiet s3://bench/m/{UNIT} "
                        f'"$1"/checkpoint-100 && {SYNC_FOLDER}',
                        "-",
                        str(d),
                    ],
                    env,
                ),
                "boto3 download_file + fsync (S3)": lambda d: timed(
                    [sys.executable, "-c", BOTO3_DOWNLOAD, weed.endpoint, "bench", f"m/{UNIT}", str(d / UNIT)], env
                ),
                "mirrord restore (S3)": lambda d: timed(
                    [*mirrord, "restore", "--mirror", "s3://bench/m", "--to", str(d)], no_config
                ),
            }
            names = list(cases)
            for rep in range(args.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotated per repetition
                    dest = work / "out" / name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "and")
                    dest.mkdir(parents=True)
                    if "boto3" in name:
                        (dest / UNIT).mkdir(parents=True)
                    loads.append(load_average()[0])
                    times.setdefault(name, []).append(cases[name](dest))
                    restored = dest / UNIT if "mirrord" in name or "boto3" in name else dest / "checkpoint-100"
                    assert sum(p.stat().st_size for p in restored.iterdir()) == size, name
                    shutil.rmtree(dest)
        rows: dict[str, dict[str, object]] = {}
        for name, runs in times.items():
            over = times["cp -r + sync (local)" if "local" in name else "aws s3 cp --recursive + sync (S3)"]
            rows[name] = {
                "seconds": statistics.median(runs),
                "MiB_per_s": size / MiB / statistics.median(runs),
                "ratio": statistics.median(t / base_t for t, base_t in zip(runs, over, strict=True)),
                "runs": runs,
            }
        _write(rows, size, args.reps, loads)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keys(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_REGION"],
    }


def _write(rows: dict[str, dict[str, object]], size: int, reps: int, loads: list[float]) -> None:
    RESULTS.mkdir(exist_ok=True)
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    document = {"bytes": size, "reps": reps, "load_average_1min": load, "cases": rows}
    (RESULTS / "restore.json").write_text(json.dumps(document, indent=2))
    lines = [
        f"# Restore of one {size / MiB:.0f} MiB HF Trainer folder checkpoint, no config file (median of {reps})",
        "",
        f"{os.cpu_count()} CPUs, 1-minute load average {load} during the run. Ratio: paired, over `cp -r` + sync "
        "(local) or `aws s3 cp --recursive` + sync (S3) in the same repetition.",
        "",
        "| case | seconds | MiB/s | ratio |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {row['seconds']:.2f} | {row['MiB_per_s']:.0f} | {row['ratio']:.2f}x |"
        for name, row in rows.items()
    ]
    (RESULTS / "restore.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
