"""Which S3 client the object-store mirror uses, by measurement: boto3 (+ s3transfer) vs obstore.

Same SeaweedFS (tests/s3/seaweed.py, on 127.0.0.1), same files, same run, paired repetitions in a
rotated order; every case uploads with the same part size and the same number of requests in flight.

    python -m bench.s3_clients [--big-mib 512] [--small 200] [--reps 2] [--concurrency 8]

Writes bench/results/s3_clients.{md,json}. obstore is imported only here (pip install obstore to
measure it); mirrord itself depends on boto3 only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results"


def make_files(root: Path, big_mib: int, small: int) -> dict[str, list[Path]]:
    """Incompressible data (a compressing client or server must not look fast), written once."""
    sets: dict[str, list[Path]] = {"big": [], "small": []}
    big = root / "big.bin"
    if not big.exists() or big.stat().st_size != big_mib * MiB:
        with big.open("wb") as fh:
            for _ in range(big_mib):
                fh.write(os.urandom(MiB))
    sets["big"].append(big)
    for i in range(small):
        path = root / "small" / f"ckpt_{i:03d}.pt"
        path.parent.mkdir(exist_ok=True)
        if not path.exists():
            path.write_bytes(os.urandom(4 * MiB))
        sets["small"].append(path)
    for path in (*sets["big"], *sets["small"]):  # in the page cache, as a checkpoint just written
        with path.open("rb", buffering=0) as fh:
            while fh.read(8 * MiB):
                pass
    return sets


class Boto3Transfer:
    """boto3's managed transfer (s3transfer): what `aws s3 cp` uses."""

    name = "boto3 + s3transfer (upload_file)"

    def __init__(self, endpoint: str, bucket: str, part: int, concurrency: int) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=concurrency * 2))
        self.bucket = bucket
        self.config = TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency, use_threads=True
        )

    def upload(self, path: Path, key: str) -> None:
        self.client.upload_file(str(path), self.bucket, key, Config=self.config)


class Boto3Multipart:
    """botocore's low-level calls, multipart driven by us: create, upload_part with `concurrency` parts
    in flight (each read once from the file), complete (abort on failure). mirrord's shape."""

    name = "boto3 explicit multipart (mirrord's shape)"

    def __init__(self, endpoint: str, bucket: str, part: int, concurrency: int) -> None:
        import boto3
        from botocore.config import Config

        self.client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=concurrency * 2))
        self.bucket, self.part, self.concurrency = bucket, part, concurrency
        self.pool = ThreadPoolExecutor(concurrency)

    def upload(self, path: Path, key: str) -> None:
        size = path.stat().st_size
        if size <= self.part:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=path.read_bytes())
            return
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            futures = []
            with path.open("rb", buffering=0) as fh:
                number = 1
                while chunk := fh.read(self.part):
                    if len(futures) >= self.concurrency:  # memory bounded by parts in flight
                        futures[-self.concurrency].result()
                    futures.append(self.pool.submit(self._part, key, upload_id, number, chunk))
                    number += 1
            parts = [f.result() for f in futures]
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _part(self, key: str, upload_id: str, number: int, chunk: bytes) -> dict[str, Any]:
        etag = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk)[
            "ETag"
        ]
        return {"PartNumber": number, "ETag": etag}


class Obstore:
    """obstore.put (Rust object_store): multipart with its own concurrency for large inputs."""

    name = "obstore put"

    def __init__(self, endpoint: str, bucket: str, part: int, concurrency: int) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            bucket,
            endpoint=endpoint,
            allow_http=True,
            region=os.environ["AWS_REGION"],
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        )
        self.part, self.concurrency = part, concurrency

    def upload(self, path: Path, key: str) -> None:
        import obstore

        obstore.put(self.store, key, path, chunk_size=self.part, max_concurrency=self.concurrency)


CLIENTS: list[type[Any]] = [Boto3Transfer, Boto3Multipart, Obstore]


def run_case(client: Any, files: list[Path], prefix: str, concurrency: int) -> tuple[float, float]:
    """Upload every file (files in parallel, `concurrency` at once); (wall s, CPU s of this process)."""
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if len(files) == 1:
        client.upload(files[0], f"{prefix}/{files[0].name}")
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda p: client.upload(p, f"{prefix}/{p.name}"), files))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mib", type=int, default=512)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.s3.seaweed import running_seaweed

    work = args.workdir or Path(tempfile.mkdtemp(prefix="mirrord-bench-s3-"))
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    sets = make_files(data, args.big_mib, args.small)
    clients = []
    for cls in CLIENTS:
        try:
            __import__("obstore" if cls is Obstore else "boto3")
            clients.append(cls)
        except ImportError:
            print(f"skipped {cls.name}: not installed", flush=True)
    times: dict[str, dict[str, list[tuple[float, float]]]] = {c.name: {"big": [], "small": []} for c in clients}
    import shutil

    shutil.rmtree(work / "server", ignore_errors=True)  # a fresh server: no bucket from a last run
    with running_seaweed(work / "server") as server:
        os.environ.update(server.env())
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket="bench")
        for rep in range(args.reps):
            order = clients[rep % len(clients) :] + clients[: rep % len(clients)]
            for dataset in ("big", "small"):
                for cls in order:
                    client = cls(server.endpoint, "bench", args.part_mib * MiB, args.concurrency)
                    wall, cpu = run_case(client, sets[dataset], f"r{rep}/{cls.__name__}/{dataset}", args.concurrency)
                    times[cls.name][dataset].append((wall, cpu))
                    print(f"rep {rep} {dataset:5} {cls.name:45} {wall:7.2f} s  cpu {cpu:6.2f} s", flush=True)
    sizes = {"big": args.big_mib * MiB, "small": args.small * 4 * MiB}
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_at_end": os.getloadavg()},
        "settings": vars(args) | {"workdir": str(work), "out": str(args.out)},
        "results": {
            name: {
                ds: {
                    "median_s": statistics.median(w for w, _ in runs),
                    "runs_s": [round(w, 3) for w, _ in runs],
                    "cpu_s": statistics.median(c for _, c in runs),
                    "MiB_per_s": sizes[ds] / MiB / statistics.median(w for w, _ in runs),
                }
                for ds, runs in per.items()
            }
            for name, per in times.items()
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "s3_clients.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# S3 client for the object-store mirror: upload to SeaweedFS on 127.0.0.1 "
        f"({args.reps} paired reps, medians, {args.part_mib} MiB parts, {args.concurrency} in flight)",
        "",
        f"| client | 1 x {args.big_mib} MiB s | MiB/s | CPU s | {args.small} x 4 MiB s | MiB/s | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, per in report["results"].items():
        b, s = per["big"], per["small"]
        lines.append(
            f"| {name} | {b['median_s']:.2f} | {b['MiB_per_s']:.0f} | {b['cpu_s']:.1f} | "
            f"{s['median_s']:.2f} | {s['MiB_per_s']:.0f} | {s['cpu_s']:.1f} |"
        )
    lines += [
        "",
        f"Load average at the end: {report['machine']['load_at_end']} on {os.cpu_count()} CPUs "
        "(the machine is shared; figures are relative, same run).",
    ]
    (args.out / "s3_clients.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
