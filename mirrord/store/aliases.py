"""Alias symlinks (Lightning's `save_last="link"`: `last.ckpt -> epoch=4-step=20.ckpt`) on the mirror.

A symlink is never copied as a file (it could point anywhere). An alias that names a checkpoint in its
own folder is recreated on the mirror as the same relative symlink, and only once that checkpoint is
mirrored and recorded: a resume from the mirror's `last.ckpt` then finds the very step it names.
Published like any name: the link is made under a temp name, renamed into place, the folder fsynced.
"""

from __future__ import annotations

import json
import math
import os
import stat
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from posixpath import dirname
from typing import TYPE_CHECKING, Any

from mirrord.core.model import ManifestEntry
from mirrord.errors import MirrordError, UnsafePathError
from mirrord.formats import safepickle
from mirrord.layouts import HF_STATE, Layout
from mirrord.paths import open_file_beneath, split_rel
from mirrord.store import atomic
from mirrord.store.staging import dir_beneath

if TYPE_CHECKING:
    from mirrord.store.mirror import ReadableStore


def _readlink(root: Path, rel: str) -> str | None:
    """The target of the symlink root/rel (reached without following any other symlink), or None."""
    parts = split_rel(rel)
    try:
        with dir_beneath(root, parts[:-1]) as dir_fd:
            if not stat.S_ISLNK(os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return None
            return os.readlink(parts[-1], dir_fd=dir_fd)
    except OSError:
        return None


def _beside(name: str | None) -> bool:
    """A plain name in the pointer's own folder (no path, not hidden): all a pointer may lead to."""
    return bool(name and "/" not in name and not name.startswith("."))


def alias_links(skipped: Iterable[tuple[str, str]], layout: Layout) -> list[str]:
    """The listed symlinks that are the layout's aliases (not worth a warning: they are handled here)."""
    return [rel for rel, why in skipped if why == "symlink" and rel.rsplit("/", 1)[-1] in layout.aliases]


def mirror_alias_links(
    primary_root: Path, mirror_root: Path, links: Iterable[str], manifest: Mapping[str, ManifestEntry]
) -> list[tuple[str, str]]:
    """Recreate each alias symlink whose target (a file in the same folder) is recorded in the manifest;
    returns (alias, target) for each link made or changed."""
    made = []
    for rel in links:
        target = _readlink(primary_root, rel)
        if target is None or not _beside(target):
            continue  # only a name in the same folder: anything else could lead out of the mirror
        folder = dirname(rel)
        if (f"{folder}/{target}" if folder else target) not in manifest or _readlink(mirror_root, rel) == target:
            continue
        parts = split_rel(rel)
        with dir_beneath(mirror_root, parts[:-1]) as dir_fd:
            atomic.publish_symlink(dir_fd, parts[-1], target)
        made.append((rel, target))
    return made


def pointed_targets(root: Path, runs: Iterable[str], layout: Layout) -> frozenset[str]:
    """What the pointers in each run folder on this root name, as root-relative paths: an alias symlink's
    target (`last.ckpt -> epoch=4-step=20.ckpt`) and the folder a tag file names (DeepSpeed's `latest`).
    Retention keeps those while the pointer names them; an unreadable pointer names nothing."""
    named: set[str] = set()
    for run in runs:
        prefix = f"{run}/" if run else ""
        for alias in layout.aliases:
            target = _readlink(root, prefix + alias)
            if _beside(target):
                named.add(f"{prefix}{target}")
        if layout.tag_file:
            named |= _tagged(prefix, _read_beneath(root, prefix + layout.tag_file, 256))
    return frozenset(named)


def _tagged(prefix: str, data: bytes | None) -> set[str]:
    """The folder a tag file's bytes name beside it (prefix: its run's), if they name one."""
    tag = (data or b"").decode("utf-8", "replace").strip()
    return {prefix + tag} if _beside(tag) else set()


def _read_beneath(root: Path, rel: str, limit: int) -> bytes | None:
    """Up to `limit` bytes of the regular file root/rel (reached beneath the root, never blocking on a
    FIFO); None if it cannot be read."""
    try:
        fd = open_file_beneath(root, rel, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, UnsafePathError):
        return None
    try:
        return os.read(fd, limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


STATE_BYTES = 1 << 20  # a trainer_state.json larger than this names nothing (it is read at every pass)
CKPT_STATE_BYTES = 64 << 20  # a Lightning checkpoint's data.pkl: its structure and storage ids, no tensor bytes
KEPT_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


def trainer_kept(
    root: Path, recorded: Iterable[str] | Mapping[str, ManifestEntry], layout: Layout
) -> tuple[frozenset[str], dict[str, float]]:
    """The checkpoints the trainer's own bookkeeping in each run's newest recorded checkpoint still keeps, read
    on `root`, as root-relative paths: the HF Trainer's `best_model_checkpoint` (its trainer_state.json), or
    Lightning's ModelCheckpoint state (`best_k_models`, `best_model_path`, `kth_best_model_path`,
    `last_model_path`, read without running its pickle). Unreadable, too large or naming nothing: none.
    Also, per run, how many checkpoints the trainer keeps by that record (mirrord.core.retention.PruneRequest
    .keeps): HF's `save_total_limit` in training_args.bin (read without running its pickle; none: inf), or 0
    when every ModelCheckpoint ranks a top k (what it does not name, it dropped). Names without a step
    (`recorded` the manifest's entries): the newest recorded is read."""
    hf = layout.rule == "hf"
    newest: dict[str, tuple[int, str]] = {}
    for rel in recorded:
        unit, _, name = rel.rpartition("/")
        where = unit if hf else rel  # hf: the unit folder holding the state file
        step = layout.step_of(where.rpartition("/")[2]) if name == HF_STATE or not hf else None
        if step is None and isinstance(recorded, Mapping) and not hf and layout.is_unit_name(name):
            step = None if layout.is_alias(rel) else recorded[rel].seq  # no step in the name: the newest recorded
        if step is not None and step >= newest.get(dirname(where), (-1, ""))[0]:
            newest[dirname(where)] = (step, where)
    named: set[str] = set()
    keeps: dict[str, float] = {}
    for run, (_, where) in newest.items():
        paths, keep = (_hf_kept if hf else _model_checkpoint_paths)(root, where)
        if keep is not None:
            keeps[run] = keep
        for path in paths:
            name = path.rstrip("/").rpartition("/")[2]
            if layout.is_unit_name(name) and not layout.is_alias(name):
                named.add(f"{run}/{name}" if run else name)
    return frozenset(named), keeps


def _hf_kept(root: Path, unit: str) -> tuple[list[str], float | None]:
    """The HF Trainer's best_model_checkpoint in the unit's trainer_state.json ([] if unreadable), and the
    save_total_limit recorded in its training_args.bin (inf: it keeps all; None if unreadable)."""
    data = _read_beneath(root, f"{unit}/{HF_STATE}", STATE_BYTES + 1)
    try:
        best = json.loads(data[:STATE_BYTES]).get("best_model_checkpoint") if data is not None else None
    except (ValueError, AttributeError):
        best = None
    named = [best] if isinstance(best, str) else []
    args = _torch_saved(root, f"{unit}/training_args.bin")
    fields = args.fields() if isinstance(args, safepickle.Instance) else {}
    limit = fields.get("save_total_limit", "")
    if limit is not None and type(limit) is not int:
        return named, None
    return named, math.inf if limit is None or limit <= 0 else limit  # (the Trainer rotates only above 0)


def _torch_saved(root: Path, rel: str) -> Any:
    """The structure of what torch.save wrote at root/rel (its data.pkl, read without running it; storages as
    None); None if unreadable or larger than CKPT_STATE_BYTES."""
    try:
        fd = open_file_beneath(root, rel, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, UnsafePathError):
        return None
    try:
        with os.fdopen(fd, "rb") as f, zipfile.ZipFile(f) as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
            return safepickle.load(archive.read(info), storages=True) if info.file_size <= CKPT_STATE_BYTES else None
    except (OSError, StopIteration, ValueError, EOFError, NotImplementedError, zipfile.BadZipFile):
        return None  # (safepickle.UnreadableError is a ValueError)


def _model_checkpoint_paths(root: Path, rel: str) -> tuple[list[str], float | None]:
    """The paths the ModelCheckpoint callbacks' state in the checkpoint root/rel names ([] if unreadable), and
    0 when they are all it keeps: each callback ranks a top k (without a monitor, `best_k_models` is empty)."""
    state = _torch_saved(root, rel)
    callbacks = state.get("callbacks") if isinstance(state, dict) else None
    paths: list[object] = []
    ranked: list[bool] = []
    for key, kept in callbacks.items() if isinstance(callbacks, dict) else ():
        if str(key).startswith("ModelCheckpoint") and isinstance(kept, dict):
            paths += [kept.get(k) for k in KEPT_PATHS] + list(kept.get("best_k_models") or ())
            ranked.append(bool(kept.get("best_k_models")))
    return [p for p in paths if isinstance(p, str)], 0 if ranked and all(ranked) else None


def tagged_targets(store: ReadableStore, runs: Iterable[str], tag_file: str) -> frozenset[str]:
    """pointed_targets for a store without a root (objects): the folder each run's tag file names (an object
    store holds no symlinks: an alias there is a copy of its own, never dangling). An absent or unreadable
    tag names nothing."""
    named: set[str] = set()
    for run in runs:
        prefix = f"{run}/" if run else ""
        try:
            with store.open_read(prefix + tag_file) as stream:
                named |= _tagged(prefix, stream.read(256))
        except (OSError, MirrordError):
            continue
    return frozenset(named)
