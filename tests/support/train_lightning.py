"""A tiny Lightning run on CPU: `ModelCheckpoint` saves `epoch=E-step=N.ckpt` at the end of every epoch,
keeps the --keep newest (monitor "step"), and writes `last.ckpt` as a copy (--last copy) or a symlink
(--last link); resumable with `Trainer.fit(ckpt_path=...)`.

    python -m tests.support.train_lightning OUT --epochs 6 --keep 2 --last copy [--resume CKPT]
        [--monitor-best-at EPOCH [--filename "{epoch}-{val_loss:.2f}"]]

With --monitor-best-at, checkpoints are ranked by a scripted `val_loss` (lowest at that epoch, then falling
from 0.9 each epoch), so Lightning keeps the best early one and rotates the others away.

One epoch is --batches steps, so that every checkpoint falls on an epoch boundary and a resume replays
nothing. Prints one JSON line per step, {"step": N, "loss": L}. Model, data and seeds are built in code.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batches", type=int, default=2, help="steps per epoch")
    p.add_argument("--steps", type=int, help="instead of --epochs: this many steps (whole epochs)")
    p.add_argument("--stop-after", type=int, help="exit after this step (a job that ended; whole epochs)")
    p.add_argument(
        "--save-until",
        type=int,
        help="no save after it: a job that died there, trained on",
    )
    p.add_argument("--keep", type=int, default=2, help="-1: keep every checkpoint")
    p.add_argument("--last", choices=["copy", "link"], default="copy")
    p.add_argument("--resume", help='a .ckpt to resume from ("last": OUT/last.ckpt, as Lightning finds it)')
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace: sleep after each step")
    p.add_argument("--monitor-best-at", type=int, help="rank by a scripted val_loss, best at this epoch")
    p.add_argument("--filename", help="ModelCheckpoint's filename template")
    args = p.parse_args()
    steps = args.stop_after or args.steps
    epochs = args.epochs if steps is None else steps // args.batches

    torch.set_num_threads(1)
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    # Lightning's advice for a laptop-sized run (few workers, no GPU, tiny batches): not our subject.
    warnings.filterwarnings("ignore", message=".*(num_workers|GPU available|does not have many workers).*")

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1)
            )

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            print(json.dumps({"step": self.global_step + 1, "loss": loss.item()}), flush=True)
            if args.step_seconds:
                time.sleep(args.step_seconds)  # a slower trainer, so that a mirror runs alongside
            return loss

        def validation_step(self, batch: Any, _index: int) -> None:
            epoch = self.current_epoch
            self.log("val_loss", 0.1 if epoch == args.monitor_best_at else 0.9 - 0.05 * epoch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    lightning.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(8 * args.batches, args.width, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    monitor = ("step", "max") if args.monitor_best_at is None else ("val_loss", "min")

    class SavingUntil(ModelCheckpoint):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            if args.save_until is None or trainer.global_step <= args.save_until:
                super().on_train_epoch_end(trainer, module)

    # (the subclass only where asked: Lightning keys a callback's state by its class name, ModelCheckpoint{...})
    checkpoints = (ModelCheckpoint if args.save_until is None else SavingUntil)(
        dirpath=args.out,
        monitor=monitor[0],
        mode=monitor[1],
        save_top_k=args.keep,
        every_n_epochs=1,
        save_last="link" if args.last == "link" else True,
        filename=args.filename,
    )
    trainer = lightning.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
    )
    validation = None if args.monitor_best_at is None else loader
    trainer.fit(Tiny(), loader, validation, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
