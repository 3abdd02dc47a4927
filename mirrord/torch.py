"""Training-side helpers: save a checkpoint that is never seen half-written, and find the one to resume from.

    from mirrord.torch import atomic_save, latest_checkpoint

    atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                run_dir / f"step_{step:08d}.pt")
    resume = latest_checkpoint(run_dir, require_manifest=False)  # None on a fresh start
    resume = restore_latest("s3://bucket/ckpt", run_dir.parent, run=run_dir.name)  # the primary is gone

This is the only mirrord module that imports torch; the daemon never imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch

from mirrord.errors import NothingToRestoreError
from mirrord.layouts import Layout
from mirrord.store.atomic import atomic_output
from mirrord.store.hashing import Hasher, new_hasher
from mirrord.store.resume import latest_checkpoint

__all__ = ["SaveResult", "atomic_save", "latest_checkpoint", "restore_latest"]


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What was published: the digest is in the manifest's format, so a mirror can be checked against it."""

    path: Path
    size: int
    algo: str
    digest: str


class _HashingWriter:
    """Hands torch.save's bytes to the file and the hasher in one pass, so the file is never re-read."""

    def __init__(self, out: BinaryIO, hasher: Hasher) -> None:
        self._out = out
        self._hasher = hasher
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self._hasher.update(data)
        written = self._out.write(data)
        self.size += written
        return written

    def flush(self) -> None:
        self._out.flush()


def atomic_save(
    obj: object, path: str | os.PathLike[str], *, algo: str = "blake3", **torch_save_kwargs: Any
) -> SaveResult:
    """torch.save `obj` so that `path` holds either its previous content or the whole new checkpoint.

    Writes PATH.part in the same directory, fsyncs it, renames it onto PATH and fsyncs the directory.
    If torch.save raises (or the process is interrupted) the .part is removed and PATH is untouched;
    a process killed outright leaves only a .part, which discovery ignores. `algo` is one of
    mirrord.store.hashing.ALGORITHMS; other keyword arguments go to torch.save.
    """
    final = Path(path)
    hasher = new_hasher(algo)  # an unknown algorithm fails before anything is written
    with atomic_output(final) as out:
        writer = _HashingWriter(out, hasher)
        # torch.save only calls write() and flush() on a file-like object.
        torch.save(obj, cast(IO[bytes], writer), **torch_save_kwargs)
    return SaveResult(final, writer.size, algo, hasher.hexdigest())


def restore_latest(
    mirror: str | os.PathLike[str], dest: str | os.PathLike[str], run: str | None = None, layout: Layout | None = None
) -> Path | None:
    """Bring the newest verified checkpoint of `run` (left out: the mirror's only run) back from `mirror` (a
    folder or an `s3://bucket/prefix` URL; S3 settings from the AWS_* environment) to the same relative path
    below `dest`, checked as `mirrord restore` does; the path to resume from. None only when the mirror
    records no checkpoint of that run; ValueError for a run it does not hold, no `run` among several (both
    list the runs) or a run folder given as the mirror. DamagedCopyError when every copy is damaged.
    What a checkpoint is (a file, a folder with all its files) the mirror's record says; `layout`
    (Config.rules) only places files recorded by an older mirrord, which are otherwise each a unit of their own."""
    from mirrord.store.restore import restore
    from mirrord.store.resume import refuse_run_folder
    from mirrord.store.targets import mirror_for

    store = mirror_for(os.fspath(mirror))
    if not store.exists():
        raise FileNotFoundError(f"restore_latest: the mirror {store.describe()} does not exist")
    if (local := store.local_tree()) is not None:
        refuse_run_folder(local.root, "restore_latest({mirror}, dest, run={run})")
    try:
        return restore(store, Path(dest), layout, run).path
    except NothingToRestoreError:
        return None
