"""S3 requests per mirrored checkpoint at steady state: a real `mirrord run` against SeaweedFS, one run keeping
KEPT checkpoints in the bucket (keep_last = KEPT: 100 as issue 44 asks, 12 the default), each new checkpoint
uploaded and the oldest pruned; every HTTP request the daemon sends counted by operation on the wire
(tests.support.s3requests).

    python -m bench.s3_requests [--measured 20] [--kept 100,12]

Writes bench/results/s3_requests.{md,json}. A count, not a timing: the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def measure(work: Path, measured: int, kept: int) -> dict[str, float]:
    """Requests per checkpoint by operation, over `measured` checkpoints after one that reaches steady state."""
    import boto3

    from tests.s3.seaweed import running_seaweed
    from tests.support import s3requests

    with running_seaweed(work / "weed") as weed:
        env = weed.env()
        boto3.client(
            "s3",
            endpoint_url=weed.endpoint,
            region_name=env["AWS_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket="bench-requests")
        s3 = {"endpoint_url": weed.endpoint, "addressing_style": "path"}
        per, _ = s3requests.steady_state(work, "s3://bench-requests/p", env, s3, kept, measured)
    per["LIST (all)"] = sum(per.get(op, 0.0) for op in s3requests.LISTS)
    per["all"] = sum(v for op, v in per.items() if op != "LIST (all)")
    return per


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--measured", type=int, default=20)
    parser.add_argument("--kept", default="100,12")
    args = parser.parse_args(argv)
    cases = {}
    for kept in map(int, args.kept.split(",")):
        with tempfile.TemporaryDirectory(prefix="mirrord-bench-") as tmp:
            cases[kept] = measure(Path(tmp), args.measured, kept)
    doc: dict[str, Any] = {"measured": args.measured, "per_checkpoint": {f"keep_last {k}": v for k, v in cases.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "s3_requests.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# S3 requests per mirrored checkpoint at steady state",
        "",
        f"A real `mirrord run` against SeaweedFS, one run keeping keep_last checkpoints in the bucket, "
        f"{args.measured} new checkpoints each uploaded and the oldest pruned; every request counted on the wire.",
        "Target (issue 44, at 100 checkpoints in the bucket): LIST <= 1 per checkpoint.",
        "",
        "| operation | " + " | ".join(f"keep_last {k}" for k in cases) + " |",
        "|---|" + "---|" * len(cases),
        *(
            f"| {op} | " + " | ".join(f"{per.get(op, 0):g}" for per in cases.values()) + " |"
            for op in dict.fromkeys(op for per in cases.values() for op in per)
        ),
    ]
    (RESULTS / "s3_requests.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
