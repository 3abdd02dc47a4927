"""A tiny deterministic trainer that saves in the on-disk format of a training stack mirrord knows, and resumes
the way that stack does, for the restore drills (tests/support/drill.py):

    accelerate  `accelerator.save_state(OUT/checkpoint_N)` (model, optimizer, RNG states, a registered step
                object); resumed with `accelerator.load_state(DIR)`
    hf_model    `huggingface_hub.save_torch_state_dict` into OUT/checkpoint-N/ (sharded safetensors and
                their index, what `save_pretrained` writes); resumed with `huggingface_hub.load_torch_model`.
                Plain SGD, so the model is the whole training state; the step is in the folder's name
    megatron    OUT/iter_000000N/mp_rank_00/model_optim_rng.pt by torch.save in place, then rank 0's tracker
                `latest_checkpointed_iteration.txt`; resumed as Megatron does: DIR's tracker names the iteration
    custom      OUT/ckpt_N/ with model.pt, optim.pt and a COMMITTED marker written last; resumed from DIR

    python -m tests.support.train_formats OUT --layout LAYOUT --steps 6 [--resume DIR] [--stop-after N]
        [--save-until N]

Prints one JSON line per step, {"step": N, "loss": L} (the exact float); saves every 2 steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

TRACKER = "latest_checkpointed_iteration.txt"


class StepCounter:
    """The training step, registered with accelerate so that save_state writes it and load_state reads it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", required=True, choices=["accelerate", "hf_model", "megatron", "custom"])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument(
        "--save-until",
        type=int,
        help="no save after it: a job that died there, trained on",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    momentum = 0.0 if args.layout == "hf_model" else 0.9  # a model folder holds no optimizer state
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=momentum)
    counter = StepCounter()
    accelerator: Any = None
    if args.layout == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        accelerator.register_for_checkpointing(counter)
    if args.resume is not None:
        resumed = resume(args.layout, args.resume, model, opt, accelerator)
        counter.step = counter.step if resumed is None else resumed
    args.out.mkdir(parents=True, exist_ok=True)
    for step in range(counter.step + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        counter.step = step
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
        if step % 2 == 0 and step <= (args.save_until or step):
            save(args.layout, args.out, step, model, opt, accelerator)
        if args.stop_after is not None and step >= args.stop_after:
            break


def save(
    layout: str, out: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, accelerator: Any
) -> None:
    if layout == "accelerate":
        accelerator.save_state(str(out / f"checkpoint_{step}"))
    elif layout == "hf_model":
        from huggingface_hub import save_torch_state_dict

        (out / f"checkpoint-{step}").mkdir()
        save_torch_state_dict(model.state_dict(), out / f"checkpoint-{step}", max_shard_size=2048)
    elif layout == "megatron":
        folder = out / f"iter_{step:07d}" / "mp_rank_00"
        folder.mkdir(parents=True)
        state = {"iteration": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
        torch.save(state, folder / "model_optim_rng.pt")
        (out / TRACKER).write_text(str(step))  # rank 0, after every rank saved
    else:
        folder = out / f"ckpt_{step}"
        folder.mkdir()
        torch.save(model.state_dict(), folder / "model.pt")
        torch.save({"optimizer": opt.state_dict(), "step": step}, folder / "optim.pt")
        (folder / "COMMITTED").write_text("")


def resume(
    layout: str, where: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, accelerator: Any
) -> int | None:
    """The step resumed at (None: in the registered StepCounter), after loading the state the way the stack's
    own resume does."""
    if layout == "accelerate":
        accelerator.load_state(str(where))
        return None
    if layout == "hf_model":
        from huggingface_hub import load_torch_model

        load_torch_model(model, where)
        return int(where.name.removeprefix("checkpoint-"))
    if layout == "megatron":
        iteration = int((where / TRACKER).read_text().strip())
        state = torch.load(where / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return int(state["iteration"])
    model.load_state_dict(torch.load(where / "model.pt", weights_only=True))
    state = torch.load(where / "optim.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


if __name__ == "__main__":
    main()
