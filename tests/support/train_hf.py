"""A tiny Hugging Face `Trainer` run on CPU: checkpoint-N/ folders every --save-steps, rotated by
--save-total-limit, resumable with `Trainer.train(resume_from_checkpoint=...)`.

    python -m tests.support.train_hf OUT --steps 12 --save-steps 2 --save-total-limit 2 [--resume DIR]
        [--stop-after N] [--best-at STEP]

With --best-at, every save is evaluated with a scripted eval_loss (lowest at that step) and
`load_best_model_at_end` with `metric_for_best_model="loss"`: the Trainer keeps that checkpoint through
its rotation.

Prints one JSON line per optimizer step, {"step": N, "loss": L} (the exact float), so that a test can
compare a resumed run with an uninterrupted one. The model (a one-layer GPT-2) and the data are built
in code from fixed seeds: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=2, help="0: keep every checkpoint")
    p.add_argument("--resume", help="a checkpoint-N folder to resume from")
    p.add_argument("--stop-after", type=int, help="end after this step (a job that ended): as if killed there")
    p.add_argument(
        "--save-until",
        type=int,
        help="no save after it: a job that died there, trained on",
    )
    p.add_argument("--width", type=int, default=64, help="embedding width (the checkpoint size grows with it)")
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace: sleep after each step")
    p.add_argument("--best-at", type=int, help="evaluate at each save, the scripted best at this step")
    args = p.parse_args()

    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1234)
            self.ids = torch.randint(0, 128, (64, 16), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Losses(TrainerCallback):  # type: ignore[misc]
        """The loss of each step, exactly: the Trainer's own log rounds it."""

        last: float | None = None

        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            print(json.dumps({"step": state.global_step, "loss": Losses.last}), flush=True)
            if args.stop_after is not None and state.global_step >= args.stop_after:
                control.should_training_stop = True  # after this step's save, and the schedule of --steps kept
            if args.save_until is not None and state.global_step > args.save_until:
                control.should_save = False  # the default flow callback, called before, asked for it
            if args.step_seconds:
                time.sleep(args.step_seconds)  # a slower trainer, so that a mirror runs alongside

    class Model(GPT2LMHeadModel):  # type: ignore[misc]
        def forward(self, *a: Any, **kw: Any) -> Any:
            out = super().forward(*a, **kw)
            if self.training:
                Losses.last = out.loss.item()
            return out

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=args.width, n_positions=16, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    model = Model(config)
    targs = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit or None,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        **(
            {}
            if args.best_at is None
            else {
                "eval_strategy": "steps",
                "eval_steps": args.save_steps,
                "load_best_model_at_end": True,
                "metric_for_best_model": "loss",
            }
        ),
    )

    class Scripted(Trainer):  # type: ignore[misc]
        def evaluate(self, *a: Any, **kw: Any) -> dict[str, float]:
            step = self.state.global_step
            return {"eval_loss": 0.1 if step == args.best_at else 0.9 - 0.01 * step}

    trainer = Scripted(
        model=model,
        args=targs,
        train_dataset=Data(),
        callbacks=[Losses()],
        eval_dataset=None if args.best_at is None else Data(),
    )
    trainer.train(resume_from_checkpoint=args.resume)


if __name__ == "__main__":
    main()
