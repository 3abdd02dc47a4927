"""Restore of one big checkpoint: `mirrord restore` next to `cp` (+ sync) from a local mirror, and next to
`aws s3 cp` and boto3's download_file (+ fsync) from SeaweedFS, in the same run, on the same file.

    python -m bench.restore [--mib 2048] [--reps 2] [--dir DIR]

The checkpoint is a real torch.save file, mirrored first by `mirrord sync`; every case writes a fresh copy
into an empty folder and makes it durable (mirrord fsyncs itself; cp and the S3 tools are followed by
`sync FILE`). Wall time includes the process start. The mirror's file is in the page cache for every local
case alike. Writes bench/results/restore.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results"
BOTO3_DOWNLOAD = """
import os, sys, boto3
c = boto3.client("s3", endpoint_url=sys.argv[1])
c.download_file(sys.argv[2], sys.argv[3], sys.argv[4])
fd = os.open(sys.argv[4], os.O_RDONLY); os.fsync(fd); os.close(fd)
"""


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    from tests.s3.seaweed import running_seaweed

    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mirrord-bench-restore-", dir=args.dir))
    mirrord = [sys.executable, "-m", "mirrord"]
    try:
        import torch

        primary, mirror = work / "primary", work / "mirror"
        (primary / "run").mkdir(parents=True)
        mirror.mkdir()
        torch.manual_seed(0)
        torch.save({"step": 1, "w": torch.randn(args.mib * MiB // 4)}, primary / "run" / "step_1.pt")
        size = (primary / "run" / "step_1.pt").stat().st_size
        local = work / "local.toml"
        local.write_text(tomli_w.dumps({"primary": str(primary), "mirror": str(mirror)}))
        subprocess.run([*mirrord, "sync", "--config", str(local)], check=True, capture_output=True)
        times: dict[str, list[float]] = {}
        with running_seaweed(work / "weed") as weed:
            env = {**os.environ, **weed.env()}
            import boto3

            boto3.client("s3", endpoint_url=weed.endpoint, **_keys(env)).create_bucket(Bucket="bench")
            remote = work / "s3.toml"
            remote.write_text(
                tomli_w.dumps(
                    {
                        "primary": str(primary),
                        "mirror": "s3://bench/m",
                        "s3": {"endpoint_url": weed.endpoint, "addressing_style": "path"},
                    }
                )
            )
            subprocess.run([*mirrord, "sync", "--config", str(remote)], check=True, capture_output=True, env=env)
            source = mirror / "run" / "step_1.pt"
            for rep in range(args.reps):
                out = work / f"out{rep}"
                cases = {
                    "cp + sync (local)": lambda d: timed(["sh", "-c", f"cp {source} {d}/ && sync {d}/step_1.pt"]),
                    "mirrord restore (local)": lambda d: timed(
                        [*mirrord, "restore", "--config", str(local), "--to", str(d)]
                    ),
                    "aws s3 cp + sync (S3)": lambda d: timed(
                        [
                            "sh",
                            "-c",
                            f"aws --endpoint-url {weed.endpoint} s3 cp "
                            f"s3://bench/m/run/step_1.pt {d}/ && sync {d}/step_1.pt",
                        ],
                        env,
                    ),
                    "boto3 download_file + fsync (S3)": lambda d: timed(
                        [
                            sys.executable,
                            "-c",
                            BOTO3_DOWNLOAD,
                            weed.endpoint,
                            "bench",
                            "m/run/step_1.pt",
                            str(d / "step_1.pt"),
                        ],
                        env,
                    ),
                    "mirrord restore (S3)": lambda d: timed(
                        [*mirrord, "restore", "--config", str(remote), "--to", str(d)], env
                    ),
                }
                for name, case in cases.items():
                    dest = out / name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "and")
                    dest.mkdir(parents=True)
                    times.setdefault(name, []).append(case(dest))
                    shutil.rmtree(dest)
        rows = {
            name: {"seconds": statistics.median(t), "MiB_per_s": size / MiB / statistics.median(t), "runs": t}
            for name, t in times.items()
        }
        _write(rows, size, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keys(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_REGION"],
    }


def _write(rows: dict[str, dict[str, object]], size: int, reps: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "restore.json").write_text(json.dumps({"bytes": size, "reps": reps, "cases": rows}, indent=2))
    lines = [
        f"# Restore of one {size / MiB:.0f} MiB torch.save checkpoint (median of {reps})",
        "",
        "| case | seconds | MiB/s |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {row['seconds']:.2f} | {row['MiB_per_s']:.0f} |" for name, row in rows.items()]
    (RESULTS / "restore.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
