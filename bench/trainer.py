"""A real CPU training loop that checkpoints with `mirrord.torch.atomic_save`: what the trainer feels.

    python -m bench.trainer --dir RUN --steps 3000 --save-every 1000 --frozen-mib 500

A small MLP (fixed seed, SGD on a fixed synthetic regression task, `--threads` torch threads, 2 by
default: every core of the build machine) behind a frozen embedding table of about `--frozen-mib` MiB,
so that each checkpoint (model state + optimizer state + step) is about that size while a step stays
cheap (a lookup and a small MLP). Every `--save-every` steps the state is saved with `atomic_save`
(temp name, fsync, rename, fsync dir).

Prints one JSON document: the wall time of every training step (forward, backward, optimizer; the
save is not part of a step), its CPU time (all of this process's threads), and the wall time of
every save. bench/goals.py runs it with and without a mirroring
daemon, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

WIDTH = 512
BATCH = 128


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__.split("\n", 1)[0])
    p.add_argument("--dir", type=Path, required=True, help="run folder the checkpoints are saved into")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--frozen-mib", type=float, default=500.0, help="size of the frozen embedding (MiB)")
    p.add_argument("--first-step", type=int, default=0, help="step number of the first step (names)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (2 = every core of this machine)")
    args = p.parse_args(argv)

    import torch
    from torch import nn

    from mirrord.torch import atomic_save

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rows = max(1, int(args.frozen_mib * 2**20 / 4 / WIDTH))
    embedding = nn.Embedding(rows, WIDTH)
    embedding.weight.requires_grad_(False)
    mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
    opt = torch.optim.SGD(mlp.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    args.dir.mkdir(parents=True, exist_ok=True)
    step_s: list[float] = []
    step_cpu_s: list[float] = []
    save_s: list[float] = []
    saved: list[str] = []
    for i in range(args.steps):
        ids = torch.randint(0, rows, (BATCH,), generator=gen)
        t0, c0 = time.perf_counter(), time.process_time()
        x = embedding(ids)
        loss = (mlp(x).squeeze(1) - x.mean(1)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        step_cpu_s.append(time.process_time() - c0)
        step = args.first_step + i + 1
        if step % args.save_every == 0:
            path = args.dir / f"step_{step:08d}.pt"
            t0 = time.perf_counter()
            atomic_save(
                {
                    "embedding": embedding.state_dict(),
                    "mlp": mlp.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                },
                path,
            )
            save_s.append(time.perf_counter() - t0)
            saved.append(path.name)
    json.dump(
        {"step_s": step_s, "step_cpu_s": step_cpu_s, "save_s": save_s, "saved": saved, "loss": float(loss.detach())},
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
