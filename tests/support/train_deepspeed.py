"""A tiny DeepSpeed run on CPU: `engine.save_checkpoint(OUT)` every --save-steps writes OUT/global_stepN/
(mp_rank_00_model_states.pt, and with ZeRO zero_pp_rank_0_mp_rank_00_optim_states.pt) and then the
`latest` tag file naming it; the oldest folders beyond --keep are removed (DeepSpeed never rotates, a
user's script does). Resumable with `engine.load_checkpoint(DIR)`, which follows DIR/latest.

    python -m tests.support.train_deepspeed OUT --steps 12 --save-steps 2 --keep 2 [--resume DIR]

One process, one rank: DeepSpeed's CPU accelerator over a gloo process group on 127.0.0.1. Prints one
JSON line per step, {"step": N, "loss": L}. Model, data and seeds are built in code; the optimizer is a
plain torch AdamW handed to deepspeed.initialize, so no DeepSpeed op is compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from tests.support.ports import free_port  # for the one-rank process group's store


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=2, help="0: never save")
    p.add_argument("--keep", type=int, default=2, help="global_step folders kept (0: all)")
    p.add_argument("--resume", help="a checkpoint directory (holding `latest`) to resume from")
    p.add_argument("--stop-after", type=int, help="exit after this step (a job that ended)")
    p.add_argument(
        "--save-until",
        type=int,
        help="no save after it: a job that died there, trained on",
    )
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace: sleep after each step")
    args = p.parse_args()

    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    # One rank: the shared-memory all-reduce would only be compiled (minutes) to never be used. DeepSpeed
    # keeps this dict for the process, edits included; gloo then does every collective.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")

    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_batch_size": 16, "zero_optimization": {"stage": args.zero_stage}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    out = Path(args.out)
    first = 1
    if args.resume:
        path, _client_state = engine.load_checkpoint(args.resume)
        assert path is not None, f"nothing to resume in {args.resume}"
        first = engine.global_steps + 1
        print(json.dumps({"resumed": str(path), "global_steps": engine.global_steps}), flush=True)
    for step in range(first, args.steps + 1):
        g = torch.Generator().manual_seed(step)  # the data of a step is a function of the step alone
        x = torch.randn(16, width, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True).sin())
        engine.backward(loss)
        engine.step()
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
        if args.save_steps and step % args.save_steps == 0 and step <= (args.save_until or step):
            engine.save_checkpoint(str(out))
            saved = sorted(
                (d for d in out.iterdir() if d.name.startswith("global_step")),
                key=lambda d: int(d.name.removeprefix("global_step")),
            )
            for old in saved[: -args.keep] if args.keep else []:
                shutil.rmtree(old)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if args.stop_after is not None and step >= args.stop_after:
            break
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
