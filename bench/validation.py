"""What does validating the source while copying cost? (issue 14: goal <= 5% wall on 2 GiB)

Writes one torch.save checkpoint (~2 GiB of random float32 tensors), keeps it in the page cache (the
trainer just wrote it), then times mirrord's own copy (mirrord.service.copier.copy_file: stream, blake3, write,
fsync, publish) in paired repetitions, side by side in the same run, on the same file:

  copy, no validation     CopyOptions(validate=False): what mirrord did before issue 14
  copy + validation       CopyOptions(validate=True), the default: the torch-zip validator is fed the
                          same buffer (CRC-32 of the stream, signatures marked), then reads the
                          central directory and the local headers (a few KB) at the end
  validate alone          mirrord.formats.validators.validate_fd on the cached file (a second read: what the
                          in-copy validation avoids), for reference

Every case starts from an empty mirror with nothing dirty in the page cache (`sync`) and ends with the
copy durable. Ratios are per repetition against "copy, no validation" of the same repetition; medians.

Run: ``python bench/validation.py [--size 2G] [--reps 7] [--workdir DIR] [--keep]``.
Results: bench/results/validation.json and .md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (python bench/X.py): make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    Case,
    GiB,
    device_of,
    log,
    make_checkpoint,
    md_table,
    parse_size,
    run_paired,
    summarize,
    warm,
    write_json,
)
from mirrord.formats.validators import validate_fd
from mirrord.service.copier import CopyOptions, copy_file
from mirrord.store.volume import LocalMirror

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "step_00000001.pt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="2G", help="checkpoint size (default 2G)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint for the next run")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    size = parse_size(args.size)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mirrord-bench-validation-"))
    primary, mirror = work / "primary", work / "mirror"
    primary.mkdir(parents=True, exist_ok=True)
    src = primary / NAME
    if not (src.exists() and abs(src.stat().st_size - size) < size // 50):
        log(f"writing a {size / GiB:.2f} GiB torch.save checkpoint")
        kind = make_checkpoint(src, size, seed=1)
    else:
        kind = "torch.save of random float32 tensors (kept from an earlier run)"
    nbytes = src.stat().st_size

    def reset() -> None:
        shutil.rmtree(mirror, ignore_errors=True)
        mirror.mkdir()
        warm([src])
        os.sync()

    def copy(validate: bool) -> Any:
        def run() -> None:
            options = CopyOptions(algo="blake3", reserve_bytes=0, drop_cache=False, validate=validate)
            result = copy_file(primary, NAME, LocalMirror(mirror), options)
            assert result.validation == ("ok" if validate else "unchecked"), result.validation

        return run

    def validate_alone() -> None:
        fd = os.open(src, os.O_RDONLY)
        try:
            assert validate_fd(fd, NAME).status == "ok"
        finally:
            os.close(fd)

    cases = [
        Case("copy, no validation", copy(False)),
        Case("copy + validation", copy(True)),
        Case("validate alone (2nd read)", validate_alone),
    ]
    run_paired(cases, reset, args.reps, label="validation")
    rows = summarize(cases, nbytes, "copy, no validation")
    machine = (
        f"{os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}; "
        f"disk {device_of(work)} (source and mirror directories on it)"
    )
    doc = {"file": {"bytes": nbytes, "kind": kind}, "reps": args.reps, "machine": machine, "rows": rows}
    write_json(args.results / "validation.json", doc)
    with_v = next(r for r in rows if r["case"] == "copy + validation")
    md = [
        "# Validation while copying (bench/validation.py)",
        "",
        f"- File: {nbytes / GiB:.2f} GiB, {kind}; in the page cache, as just written by the trainer",
        f"- Machine: {machine}",
        f'- {args.reps} paired repetitions, order rotated; medians; ratio = case / "copy, no validation" '
        "of the same repetition",
        "",
        "## Goal",
        "",
        f"copy + validation <= 1.05 x copy without: measured **{with_v['ratio']:.3f}x** "
        f"(per repetition: {', '.join(f'{r:.3f}' for r in with_v['ratios'])}) - "
        f"{'met' if with_v['ratio'] <= 1.05 else 'not met'}",
        "",
        md_table(
            ["case", "median s", "ratio", "GB/s", "CPU s/GB", "runs s"],
            [
                [
                    r["case"],
                    r["median_s"],
                    r["ratio"],
                    r["gb_per_s"],
                    r["cpu_s_per_gb"],
                    " ".join(f"{x:.2f}" for x in r["runs_s"]),
                ]
                for r in rows
            ],
        ),
        "",
    ]
    (args.results / "validation.md").write_text("\n".join(md))
    log(f"results in {args.results}/validation.md")
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
