"""Which checkpoint should a training script resume from? The newest one that is provably whole.

On a mirror, "provably whole" means: recorded in the manifest (so it was published only after its
source passed its format validator), and the file on disk is still the one recorded. That last point
is answered without reading multi-GB files on every call: the manifest records the published copy's
inode, size, mtime and ctime, and while they are unchanged the recorded hash still holds. An entry
without that record, or whose file changed by stat, is re-hashed and re-validated; `verify=True`
re-reads every candidate.

"Newest" is per run by (branch, step): after a rollback (a lower step written after a higher one,
see mirrord.core.branches) the new branch wins. Across runs, step numbers are never compared: the run
whose best checkpoint has the newest mtime wins.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from mirrord.core.branches import Recorded, branches, lying_after_ns, recorded_of
from mirrord.core.model import ManifestEntry, entry_passed, entry_whole, step_of
from mirrord.errors import UnsafePathError
from mirrord.formats.verdicts import PASSING, UNCHECKED, UNREADABLE
from mirrord.layouts import TEMP_SUFFIXES, Layout
from mirrord.store.hashing import hash_stream
from mirrord.store.manifest import MANIFEST_NAME, Manifest, upgrade
from mirrord.store.mirror import ReadableStore, random_access_fd
from mirrord.store.volume import LocalVolume, stat_safely

if TYPE_CHECKING:
    from mirrord.formats.validators import Verdict

# Re-reading (hashing, the format validators) and judging a primary's folder
# units (mirrord.store.completeness) are imported where they are needed: the usual answer is a
# manifest read and a few stats, and a training script waits on it. So are folder units
# (mirrord.core.units): a file layout's answer has none.

FUTURE_SKEW_SECONDS = 60.0  # as prune.future_skew_seconds' default
T = TypeVar("T")


def run_key(store: ReadableStore, run: str | Path | None) -> str | None:
    """The run `--run` names, as a key prefix: relative as given ('' for the top), or an absolute path
    below a local store's root. ValueError (a sentence) when it is neither."""
    if run is None:
        return None
    run_path = Path(run)
    if run_path.is_absolute():
        root = Path(store.describe())
        if not root.is_absolute() or not run_path.resolve().is_relative_to(root.resolve()):
            raise ValueError(f"{run} is not a folder under {store.describe()}")
        run_path = run_path.resolve().relative_to(root.resolve())
    key = run_path.as_posix()
    return "" if key == "." else key.strip("/")


def _by_recency(items: list[tuple[int | None, int, T]], recorded: Mapping[int, Recorded] | None = None) -> list[T]:
    """(step, mtime_ns, item) newest first: by branch and step, stepless items by mtime after them; `recorded`
    (step -> when its bytes were recorded) as in mirrord.core.branches.branches."""
    mtimes: dict[int, int] = {}
    lie = lying_after_ns(time.time(), FUTURE_SKEW_SECONDS)  # beyond: a lying clock, no evidence of order
    for step, mtime, _ in items:
        if step is not None:
            mtimes[step] = max(mtimes.get(step, 0), 0 if mtime > lie else mtime)
    order = branches(mtimes, recorded)

    def key(item: tuple[int | None, int, T]) -> tuple[int, int, int, int]:
        step, mtime, _ = item
        return (0, 0, 0, mtime) if step is None else (1, order.key(step)[0], step, mtime)

    return [item for _, _, item in sorted(items, key=key, reverse=True)]


def _newest_whole(
    listed: Iterable[tuple[str, int | None, int, T]], run_key: str | None, whole: Callable[[T], bool]
) -> list[T]:
    """Of (run, step, mtime_ns, item) of the run `run_key` (or all), per run the newest item (by
    _by_recency) that `whole` accepts."""
    by_run: dict[str, list[tuple[int | None, int, T]]] = defaultdict(list)
    for run, step, mtime, item in listed:
        if run_key is None or run == run_key:
            by_run[run].append((step, mtime, item))
    found = (next((item for item in _by_recency(items) if whole(item)), None) for items in by_run.values())
    return [item for item in found if item is not None]


@dataclass(frozen=True)
class Finding:
    """One problem verify found with a mirrored file."""

    path: str
    problem: str  # missing | size_mismatch | hash_mismatch | unreadable | unrecorded | part | <validator status>
    detail: str = ""

    @property
    def is_problem(self) -> bool:
        """ "unchecked" (a format without a validator) and "part" (an intact file of a unit still waiting
        for other nodes' shares) are worth reporting, never a failure."""
        return self.problem not in (UNCHECKED, PART)


# An unrecorded file that is part of a node's contribution to a unit not complete yet, and holds exactly
# what that node recorded (mirrord.core.contributions): not vouched for, not a problem either.
PART = "part"


def check_entry(
    store: ReadableStore, entry: ManifestEntry, pace: Callable[[int], None] | None = None, drop_cache: bool = False
) -> Finding | None:
    """None if the key entry.path holds exactly what the manifest recorded (size, then content hash). The
    stored size is compared first (a stat, an S3 HEAD): a copy that grew to terabytes is never read.
    `pace(n)` is told of every read (the scrub's pacing); `drop_cache`: a local copy's pages read are then
    dropped from the page cache (the trainer's cache stays as it was)."""
    try:
        state = store.stat(entry.path)
        if state is not None and state.is_regular and state.size != entry.size:
            size, digest = state.size, ""  # (a copy of another size is not read)
        else:
            with store.open_read(entry.path) as stream:
                size, digest = hash_stream(stream, entry.algo, pace)
                if drop_cache and hasattr(stream, "fileno"):
                    os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except FileNotFoundError:
        return Finding(entry.path, "missing", "in the manifest but not on the mirror")
    except (OSError, UnsafePathError) as exc:
        return Finding(entry.path, "unreadable", getattr(exc, "strerror", None) or str(exc))
    if size != entry.size:
        return Finding(entry.path, "size_mismatch", f"{size} bytes on the mirror, manifest says {entry.size}")
    if digest != entry.digest:
        return Finding(entry.path, "hash_mismatch", f"{entry.algo} {digest}, manifest says {entry.digest}")
    return None


def validate_key(store: ReadableStore, key: str, quick: bool = False) -> Verdict:
    """The format validator on the whole object at `key` (`quick`: structure only, a few KB read); a DCP
    file is also judged with its folder: a `.metadata` by every file it references (present, with its
    size), a `.distcp` by the byte ranges the `.metadata` beside it places in it."""
    from mirrord.formats.validators import DCP, Verdict, validate_fd

    try:
        with store.open_read(key) as stream, random_access_fd(stream) as fd:
            verdict = validate_fd(fd, key, quick=quick)
            size = os.fstat(fd).st_size
    except OSError as exc:
        return Verdict(UNREADABLE, exc.strerror or str(exc))
    if verdict.format != DCP or verdict.status not in PASSING:
        return verdict
    return Verdict(*dcp_check(store, key, size), DCP)


def dcp_check(store: ReadableStore, key: str, size: int = 0) -> tuple[str, str]:
    """(status, detail) of a DCP file judged with its folder: a `.metadata` by every file it references
    (present, with its size), a data file of `size` bytes by the range the `.metadata` beside it gives it."""
    from mirrord.formats import dcpmeta

    folder, _, name = key.rpartition("/")
    prefix = f"{folder}/" if folder else ""
    where = dcpmeta.METADATA_NAME + ("" if name == dcpmeta.METADATA_NAME else " beside it")
    try:
        with store.open_read(prefix + dcpmeta.METADATA_NAME) as stream:
            needed = dcpmeta.storage_references(stream.read(dcpmeta.MAX_METADATA_BYTES + 1))  # (it refuses more)
    except FileNotFoundError:
        return "truncated", f"{where}: missing: the save did not finish (dcp.save writes it last)"
    except OSError as exc:
        return "unreadable", f"{where}: {exc.strerror or exc}"
    except dcpmeta.MetadataError as exc:
        return exc.status, f"{where}: {exc}"
    if name == dcpmeta.METADATA_NAME:
        states = {rel: stat_safely(store, prefix + rel) for rel in needed}
        return dcpmeta.judge(
            needed, {rel: s.size if s is not None and s.is_regular else None for rel, s in states.items()}
        )
    if name not in needed:
        return "unchecked", f"not referenced by the {dcpmeta.METADATA_NAME} beside it"
    status, detail = dcpmeta.judge({name: needed[name]}, {name: size})
    return status, (f"{needed[name]} bytes, as {dcpmeta.METADATA_NAME} says" if status == "ok" else detail)


def entry_intact(store: ReadableStore, entry: ManifestEntry, verify: bool = False) -> bool:
    """The file is what the manifest recorded and passed its validator.

    Trusted by stat (inode, size, mtime, ctime as recorded) unless `verify`; otherwise re-hashed and,
    for entries recorded before validation existed, validated.
    """
    if not entry_passed(entry):
        return False
    if not verify:
        try:
            state = store.stat(entry.path)
        except (OSError, UnsafePathError):
            return False
        if state is None or not state.is_regular or state.size != entry.size:
            return False  # (a copy that grew is not read to its end to say so)
        if entry.unchanged(state):
            return True
    if check_entry(store, entry) is not None:
        return False
    if entry.validation is not None and not verify:
        return True  # the bytes are the ones that passed when they were copied
    return validate_key(store, entry.path).passed


@dataclass(frozen=True)
class Candidate:
    """A recorded unit that can be restored: a file, or a folder with all its recorded files."""

    key: str
    run: str
    step: int | None
    folder: bool
    entries: tuple[ManifestEntry, ...]


def recorded_manifest(store: ReadableStore, layout: Layout | None = None) -> Manifest:
    """The store's manifest, read-only; entries recorded before the record said what each file is are
    placed by a folder `layout` in memory (mirrord.store.manifest.upgrade), else each is a unit of its own."""
    manifest = store.load_manifest()
    if layout is not None and layout.folders:
        upgrade(manifest, layout)
    return manifest


def recorded_candidates(manifest: Manifest, run_key: str | None = None) -> dict[str, list[Candidate]]:
    """Per run, the checkpoint units the manifest records whole (every member recorded, every file passed),
    newest first: by branch and step, in the order their sources were saved (source mtime, unless recorded
    before: _by_recency).
    What a unit is, the record says (ManifestEntry.unit, role)."""
    members: dict[tuple[str, str, int | None, bool], list[ManifestEntry]] = defaultdict(list)
    for e in manifest.entries.values():
        if not e.role and (run_key is None or e.run == run_key):
            members[e.unit or e.path, e.run, e.step, bool(e.unit)].append(e)
    whole = [
        Candidate(key, run, step, folder, tuple(sorted(entries, key=lambda e: e.path)))
        for (key, run, step, folder), entries in members.items()
        if all(entry_passed(e) and (not e.layout or e.members == len(entries)) for e in entries)
    ]
    runs: dict[str, list[tuple[int | None, int, Candidate]]] = defaultdict(list)
    recorded: dict[str, dict[int, Recorded]] = defaultdict(dict)
    for c in whole:
        runs[c.run].append((c.step, max(e.source_mtime_ns for e in c.entries), c))
        if c.step is not None:
            recorded[c.run][c.step] = recorded_of(c.entries)
    return {run: _evidenced(_by_recency(items, recorded[run])) for run, items in runs.items()}


def _evidenced(newest_first: list[Candidate]) -> list[Candidate]:
    """Without the run's newest file when nothing says it is whole (entry_whole: an `unchecked` format
    written in place): only the saver's last file can be torn by a trainer that died while writing it;
    one it saved a newer checkpoint after was finished. A folder's evidence is its layout's completeness."""
    if newest_first and not newest_first[0].folder and not all(map(entry_whole, newest_first[0].entries)):
        return newest_first[1:]
    return newest_first


def newest_run(runs: dict[str, list[Candidate]]) -> str | None:
    """The run written to most recently: the one whose newest recorded file has the newest source mtime (a
    time beyond the clock's skew is no evidence), then the one mirrord listed last (ManifestEntry.seen). Not
    the listing first: a copy retried after another run's newer save would make its run look newest."""
    lie = lying_after_ns(time.time(), FUTURE_SKEW_SECONDS)

    def written(run: str) -> tuple[int, int]:
        entries = [e for c in runs[run] for e in c.entries]
        return max((e.source_mtime_ns for e in entries if e.source_mtime_ns <= lie), default=0), max(
            e.seen for e in entries
        )

    return max(runs, key=written, default=None)


def latest_key(
    store: ReadableStore,
    run_key: str | None = None,
    require_manifest: bool = True,
    patterns: Iterable[str] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
    verify: bool = False,
    layout: Layout | None = None,
) -> str | None:
    """The key of the newest whole checkpoint in `store` (of the run `run_key`, or of the run written
    to most recently); see latest_checkpoint. Works on any store: a local tree or the mirror's seam.
    With a folder layout the answer is a unit's folder."""
    manifest = recorded_manifest(store, layout)
    if len(manifest) or require_manifest:
        return _latest_recorded(store, recorded_candidates(manifest, run_key), verify)
    if layout is not None and layout.folders:
        return _latest_unit(store, run_key, layout)
    step_regex = re.compile(step_pattern)
    files = store.snapshot(patterns).files.values()
    # Stricter than passing: on a primary with no manifest, only a verdict of "ok" proves anything.
    best = _newest_whole(
        ((s.run, step_of(s.rel, step_regex), s.mtime_ns, s) for s in files),
        run_key,
        lambda s: validate_key(store, s.rel).status == "ok",
    )
    return max(best, key=lambda s: s.mtime_ns).rel if best else None


def latest_checkpoint(
    root: str | Path,
    run: str | Path | None = None,
    require_manifest: bool = True,
    patterns: Iterable[str] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
    verify: bool = False,
    layout: Layout | None = None,
) -> Path | None:
    """The newest whole checkpoint under `root` (of `run`, or of the run written to most recently).

    On a mirror: only manifest entries whose file is still the one recorded (see entry_intact); a newer
    file that is truncated, corrupt or unrecorded is skipped, never returned. With
    `require_manifest=False` and no manifest at `root` (a primary volume), the newest file that passes
    its format validator with a verdict of "ok" (a torch zip: every record's CRC) is returned instead.
    """
    if str(root).startswith("s3://"):
        raise ValueError(
            f"latest_checkpoint reads a local folder, not {root}: use "
            "mirrord.torch.restore_latest(mirror, dest) to bring the checkpoint back from S3"
        )
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"latest_checkpoint: {root} does not exist or is not a folder")
    refuse_run_folder(root, "latest_checkpoint({mirror}, run={run})")
    store = LocalVolume(root)
    key = latest_key(store, run_key(store, run), require_manifest, patterns, step_pattern, verify, layout)
    return None if key is None else root / key


def refuse_run_folder(root: Path, call: str) -> None:
    """ValueError, with the `call` to make instead ({mirror}, {run} filled in), when `root` is a folder of a
    mirror (one of its parents holds the manifest) rather than the mirror's root."""
    mirror = next((p for p in root.resolve().parents if _holds_manifest(p)), None)
    if mirror is not None and not _holds_manifest(root):
        rel = root.resolve().relative_to(mirror).as_posix()
        raise ValueError(
            f"{root} is a run folder of the mirror {mirror}: pass the mirror's root and the run, "
            + call.format(mirror=repr(str(mirror)), run=repr(rel))
        )


def _holds_manifest(folder: Path) -> bool:
    """A mirror's root: its manifest (snapshot or journal) is there."""
    return (folder / MANIFEST_NAME).exists() or any(folder.glob(MANIFEST_NAME.removesuffix(".json") + ".journal.*"))


def _latest_recorded(store: ReadableStore, runs: dict[str, list[Candidate]], verify: bool) -> str | None:
    """Per run the newest recorded unit still intact (a folder: holding exactly its recorded files); of
    those, the one of the run recorded most recently."""
    # Every file below a folder named as a recorded unit is, the record's names: no config needed.
    names = sorted({c.key.rpartition("/")[2] for units in runs.values() for c in units if c.folder})
    recorded = Layout("recorded", "folder", tuple(map(glob.escape, names)), r"(\d+)")
    listing = functools.cache(lambda: frozenset(store.snapshot((), recorded).files))  # only if a folder is checked
    intact = {
        run: next((u for u in units if _unit_intact(store, u, listing, verify)), None) for run, units in runs.items()
    }
    found = {run: [unit] for run, unit in intact.items() if unit is not None}
    best = newest_run(found)
    return None if best is None else found[best][0].key


def _latest_unit(store: ReadableStore, run_key: str | None, layout: Layout) -> str | None:
    """On a primary without a manifest, the newest folder that its layout's completeness rule calls whole."""
    from mirrord.core.units import group_units

    volume = store.local_tree()
    if volume is None:
        return None  # a primary is a local tree; judging completeness needs one
    from mirrord.store.completeness import judge

    units = [
        u for u in group_units(volume.snapshot((), layout).files.values(), layout).values() if u.role == "checkpoint"
    ]
    complete = judge(volume, layout)
    best = _newest_whole(((u.run, u.step, u.mtime_ns, u) for u in units), run_key, lambda u: complete(u).complete)
    return max(best, key=lambda u: u.mtime_ns).rel if best else None


def _unit_intact(store: ReadableStore, unit: Candidate, listing: Callable[[], frozenset[str]], verify: bool) -> bool:
    """Every recorded file intact, and (a folder) nothing else in it: the unit as it was published."""
    if unit.folder:
        prefix = unit.key + "/"
        there = {rel for rel in listing() if rel.startswith(prefix) and not rel.endswith(TEMP_SUFFIXES)}
        if there != {e.path for e in unit.entries}:
            return False
    return all(entry_intact(store, e, verify) for e in unit.entries)
