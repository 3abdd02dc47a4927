"""A trainer process that torch.saves one checkpoint *in place* (no .part, no rename: the most common way
trainers save), with a fault on the way. Run as `python -m tests.support.writer PATH STEP MODE ...` from the
repository root (see WRITER_ARGV).

modes:
  plain    write it all
  pause    stop at --at (fraction) for --pause seconds (or until --go exists), then finish
  hang     stop at --at, touch --marker, and wait to be killed (kill -9 by the test)
  silent   create the file, touch --marker, write nothing until --go exists, then write it all
  trickle  write --chunk bytes every --interval seconds (a slow writer)

The bytes are torch.save's own (tests.support.checkpoints, seeded by --seed, default the step), written in the order
torch.save produced them, flushed as they go so that a listing sees the file grow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tests.support.checkpoints import checkpoint_bytes

REPO = Path(__file__).resolve().parents[2]
# How to start it: as a module, from the repository root, so that `tests` is importable.
WRITER_ARGV = [sys.executable, "-m", "tests.support.writer"]


def touch(path: str | None) -> None:
    if path:
        Path(path).write_text(str(os.getpid()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("step", type=int)
    p.add_argument("mode", choices=["plain", "pause", "hang", "silent", "trickle"])
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--at", type=float, default=0.5)
    p.add_argument("--pause", type=float, default=3.0)
    p.add_argument("--marker")
    p.add_argument("--go")
    p.add_argument("--chunk", type=int, default=100_000)
    p.add_argument("--interval", type=float, default=0.3)
    args = p.parse_args()
    data = checkpoint_bytes(args.step, megabytes=args.mb, seed=args.seed)
    stop_at = int(len(data) * args.at)
    if args.marker:
        # Written then renamed: a test that sees the name must never read an empty file.
        Path(args.marker + ".size.tmp").write_text(str(len(data)))
        Path(args.marker + ".size.tmp").replace(args.marker + ".size")
    with open(args.path, "wb") as f:
        if args.mode == "silent":
            touch(args.marker)
            while not Path(args.go).exists():
                time.sleep(0.05)
        pos = 0
        while pos < len(data):
            size = args.chunk if args.mode == "trickle" else 1 << 20
            if args.mode in ("pause", "hang") and pos < stop_at <= pos + size:
                size = stop_at - pos
            f.write(data[pos : pos + size])
            f.flush()
            pos += size
            if args.mode == "trickle":
                time.sleep(args.interval)
            elif pos == stop_at and args.mode == "pause":
                touch(args.marker)
                deadline = time.monotonic() + args.pause
                while time.monotonic() < deadline and not (args.go and Path(args.go).exists()):
                    time.sleep(0.05)
            elif pos == stop_at and args.mode == "hang":
                touch(args.marker)
                while True:
                    time.sleep(60)
    touch(args.marker + ".done" if args.marker else None)


if __name__ == "__main__":
    main()
