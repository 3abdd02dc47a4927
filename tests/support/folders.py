"""Folder checkpoints as trainers write them, made with real torch (the trainer libraries themselves are
exercised by the library tests): a Hugging Face Trainer-like `checkpoint-N/` and a `dcp.save` `step_N/`.

Run as a script (`python -m tests.support.folders hf|dcp ROOT FIRST COUNT [--keep K] [--pause S]`) it is a
trainer: it writes COUNT checkpoints, file by file like the real libraries, rotating away all but the
K newest (as save_total_limit does).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
import warnings
from pathlib import Path

import torch

HF_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")


def _safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format by hand (8-byte header length, JSON header, raw little-endian data)."""
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def write_hf(folder: Path, step: int, width: int = 32, pause: float = 0.0) -> list[Path]:
    """checkpoint-N/ file by file, trainer_state.json last (as transformers' Trainer does)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(width, width)
    with torch.no_grad():
        model.weight.copy_(torch.randn(width, width, generator=gen))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width, generator=gen)).sum().backward()
    opt.step()
    _safetensors(folder / "model.safetensors", {k: v.detach() for k, v in model.state_dict().items()})
    time.sleep(pause)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    time.sleep(pause)
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    torch.save({"python": step, "cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    time.sleep(pause)
    state = {"global_step": step, "log_history": [{"loss": 1.0 / (step + 1), "step": step}]}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return [folder / name for name in HF_FILES]


def write_dcp(folder: Path, step: int, width: int = 32) -> list[Path]:
    """A real single-process dcp.save: __0_0.distcp, then .metadata (renamed into place last)."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(step)
    state = {"model": {"w": torch.randn(width, width, generator=gen), "b": torch.zeros(width)}, "step": step}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder))
    return sorted(p for p in folder.iterdir())


def _rotate(root: Path, prefix: str, keep: int) -> None:
    folders = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()),
        key=lambda p: int(p.name[len(prefix) :]),
    )
    for old in folders[:-keep]:
        shutil.rmtree(old)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["hf", "dcp"])
    parser.add_argument("root", type=Path)
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
        step = args.first + i * args.every
        if args.kind == "hf":
            write_hf(args.root / f"checkpoint-{step}", step, args.width, args.pause)
            prefix = "checkpoint-"
        else:
            write_dcp(args.root / f"step_{step}", step, args.width)
            prefix = "step_"
            time.sleep(args.pause)
        print(f"saved {step}", flush=True)
        if args.keep:
            _rotate(args.root, prefix, args.keep)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown races with torch's threads


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
