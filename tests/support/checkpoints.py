"""Real torch.save checkpoints: a small MLP with its Adam state after one step, and the step counter.

The same (step, shape, seed) always gives the same bytes; those up to 32 MiB are kept in memory after
the first torch.save (within a budget), so the suite pays for torch once per checkpoint.

Two ways to put one on disk:
- `save_checkpoint`: settled, for in-process tests: written in place, mtime an old known instant
  (BASE_MTIME_NS + step seconds) that the mirror must preserve.
- `publish_checkpoint`: what a trainer does while a daemon watches: NAME.part, then a rename onto
  the final name (or in place), with the mtime of the moment it was written.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

# Settled checkpoints look as if the trainer wrote them long ago; each step gets its own second.
BASE_MTIME_NS = 1_700_000_000 * 10**9

_CACHE: dict[tuple[int, int, int, int], bytes] = {}
_CACHE_ENTRY_LIMIT = 32 * 2**20
_CACHE_BUDGET = 256 * 2**20


def width_for(megabytes: float, depth: int = 2) -> int:
    """The MLP width whose checkpoint is about `megabytes` MiB (weights, exp_avg, exp_avg_sq; float32)."""
    return max(1, round(math.sqrt(megabytes * 2**20 / (12 * depth))))


def checkpoint_bytes(
    step: int, *, width: int = 64, depth: int = 2, megabytes: float | None = None, seed: int | None = None
) -> bytes:
    """torch.save's bytes for step `step` (seeded by `seed`, default the step); `megabytes` sets the width."""
    if megabytes is not None:
        width = width_for(megabytes, depth)
    seed = step if seed is None else seed
    key = (step, width, depth, seed)
    if key in _CACHE:
        return _CACHE[key]
    data = _torch_save(step, width, depth, seed)
    if len(data) <= _CACHE_ENTRY_LIMIT and sum(map(len, _CACHE.values())) + len(data) <= _CACHE_BUDGET:
        _CACHE[key] = data
    return data


def checkpoint_state(step: int = 0, *, width: int = 64, depth: int = 2, seed: int | None = None) -> dict[str, object]:
    """What a trainer checkpoints: the step, an MLP's weights and its Adam state after one step."""
    import torch  # only the tests that make checkpoints pay for importing torch

    seed = step if seed is None else seed
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for param in model.parameters():  # a real step without autograd: gives Adam its state
        param.grad = torch.randn_like(param)
    optimizer.step()
    state: dict[str, object] = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if seed != step:
        state["seed"] = seed
    return state


def _torch_save(step: int, width: int, depth: int, seed: int) -> bytes:
    import torch

    out = io.BytesIO()
    torch.save(checkpoint_state(step, width=width, depth=depth, seed=seed), out)
    return out.getvalue()


def save_checkpoint(
    path: Path,
    step: int,
    width: int = 64,
    depth: int = 2,
    mtime_ns: int | None = None,
    *,
    megabytes: float | None = None,
) -> Path:
    """A settled checkpoint at `path`, written in place; mtime `mtime_ns`, default BASE_MTIME_NS + step s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(checkpoint_bytes(step, width=width, depth=depth, megabytes=megabytes))
    mtime_ns = BASE_MTIME_NS + step * 10**9 if mtime_ns is None else mtime_ns
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def publish_checkpoint(
    path: Path, step: int, megabytes: float = 0.1, rename: bool = True, seed: int | None = None
) -> Path:
    """A checkpoint saved now, the trainer's way: NAME.part then rename (or in place, `rename=False`)."""
    data = checkpoint_bytes(step, megabytes=megabytes, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(path.name + ".part") if rename else path
    target.write_bytes(data)
    if rename:
        target.replace(path)
    return path
