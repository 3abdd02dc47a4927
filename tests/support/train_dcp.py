"""A tiny training loop that checkpoints with `torch.distributed.checkpoint.save`, single process (no
process group): step_N/ folders holding __0_0.distcp and .metadata, the oldest removed beyond --keep
(as a user's own rotation would), resumable with `dcp.load`.

    python -m tests.support.train_dcp OUT --steps 12 --save-steps 2 --keep 2 [--resume DIR] [--stop-after N]

Prints one JSON line per step, {"step": N, "loss": L}. Model, data and seeds are built in code.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def batch(step: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step, a function of the step alone: nothing to restore on resume."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, width, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--keep", type=int, default=2, help="step folders kept by the trainer (0: all)")
    p.add_argument("--resume", help="a step_N folder to resume from")
    p.add_argument("--stop-after", type=int, help="end after this step (a job that ended)")
    p.add_argument(
        "--save-until",
        type=int,
        help="no save after it: a job that died there, trained on",
    )
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace: sleep after each step")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Single process, no process group: dcp says it assumes so, once per call.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    width = args.width
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = 1
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)  # Adam's state initialised, so dcp.load can fill it
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = int(re.findall(r"\d+", Path(args.resume).name)[-1]) + 1
    for step in range(first, args.steps + 1):
        x, y = batch(step, args.width)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
        if step % args.save_steps == 0 and step <= (args.save_until or step):
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / f"step_{step}")
            saved = sorted(
                (d for d in out.iterdir() if d.name.startswith("step_")), key=lambda d: int(d.name.split("_")[1])
            )
            for old in saved[: -args.keep] if args.keep else []:
                shutil.rmtree(old)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if args.stop_after is not None and step >= args.stop_after:
            break


if __name__ == "__main__":
    main()
