"""A real torch.distributed.checkpoint save by two ranks (two processes, a gloo process group on
127.0.0.1), each rank holding its own shard of the model: `__0_0.distcp` (rank 0), `__1_0.distcp`
(rank 1) and the `.metadata` rank 0 writes last, listing both. Tests then split the folder as two
training nodes would hold it: rank 1's data file on the second node's primary.

    python -m tests.support.dcp_ranks ROOT STEP [STEP ...] [--width N]   (ROOT/step_N for each step)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

from tests.support.ports import free_port

WORLD = 2
RANK_SECONDS = 300  # a rank that has not saved by then is stuck (the machine is loaded, not that slow)


def shard(rank: int, step: int, width: int) -> dict[str, object]:
    """Rank `rank`'s part of the state: tensors of its own (names that no other rank saves, so DCP writes
    each in that rank's file) and the step."""
    import torch

    gen = torch.Generator().manual_seed(step * WORLD + rank)
    return {f"layer{rank}": {"w": torch.randn(width, width, generator=gen), "b": torch.zeros(width)}, "step": step}


def save_rank(root: Path, steps: list[int], rank: int, port: int, width: int) -> None:
    """One rank: join the gloo group, dcp.save its shard of each step into ROOT/step_N (rank 0 writes
    each .metadata last)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for step in steps:
                dcp.save(shard(rank, step, width), checkpoint_id=str(root / f"step_{step}"))
    finally:
        dist.destroy_process_group()


def save_two_ranks(root: Path, steps: list[int], width: int = 32) -> list[Path]:
    """Run both ranks as processes of their own (one process group for every step: it takes a while to
    start on a loaded machine); the step folders when both finished."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.dcp_ranks",
                str(root),
                *map(str, steps),
                "--rank",
                str(rank),
                "--port",
                str(port),
                "--width",
                str(width),
            ],
            env=env,
            start_new_session=True,
        )
        for rank in range(WORLD)
    ]
    try:
        codes = [p.wait(timeout=RANK_SECONDS) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if codes != [0] * WORLD:
        raise RuntimeError(f"dcp ranks exited with {codes}")
    return [root / f"step_{step}" for step in steps]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("steps", type=int, nargs="+")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)
    if args.rank is None:
        save_two_ranks(args.root, args.steps, args.width)
    else:
        save_rank(args.root, args.steps, args.rank, args.port, args.width)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
