"""A small deterministic trainer for the disaster drills: saves with mirrord.torch.atomic_save every
--save-every steps, resumes from --resume (model, optimizer, step), prints one JSON line per step,
{"step": N, "loss": L} (the exact float), as tests.support.train_hf and train_dcp do.

    python -m tests.support.train_resume OUT --steps 12 [--resume CKPT] [--stop-after N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mirrord.torch import atomic_save


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of `step`, the same in every run."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--stop-after", type=int, help="exit after this step (a job that ended)")
    parser.add_argument(
        "--save-until",
        type=int,
        help="no save after it: a job that died there, trained on",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    if args.resume is not None:
        state = torch.load(args.resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    args.out.mkdir(parents=True, exist_ok=True)
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
        if step % args.save_every == 0 and step <= (args.save_until or step):
            atomic_save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                args.out / f"step_{step:04d}.pt",
            )
        if args.stop_after is not None and step >= args.stop_after:
            break


if __name__ == "__main__":
    main()
