"""Checkpoint units: the files of a listing grouped into what a resume needs whole.

    snapshot files + Layout  ->  {unit path: Unit}        (group_units)
    Unit + Layout + settled + small reads  ->  Completeness   (completeness)

A unit is one checkpoint file, or one folder with every file in it, with its run (the folder that
holds it, relative to the root), its step (None: never pruned), and its role: a checkpoint, or a file
that rides along without being one (Lightning's `last.ckpt` alias, DeepSpeed's `latest` tag file).
Pure: the shell lists, stats and reads; these functions only decide.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from posixpath import dirname
from typing import Any, Literal

from mirrord.core.model import FileState, Snapshot, step_of
from mirrord.formats.dcpmeta import METADATA_NAME, MetadataError, storage_references
from mirrord.layouts import HF_STATE, LOOKALIKES, MEGATRON_TRACKER, Layout, UnitKind

Role = Literal["checkpoint", "alias", "tag"]
# The most a completeness rule reads of one file (a DCP .metadata, a trainer_state.json).
MAX_READ_BYTES = 64 * 1024 * 1024
# accelerate's save_state: model*.safetensors / pytorch_model*.bin, optimizer*.bin, scheduler*.bin,
# sampler*.bin, scaler.pt, then random_states_<process>.pkl, then custom_checkpoint_<i>.pkl per registered object.
ACCELERATE_STATE = re.compile(r"random_states_\d+\.pkl")


@dataclass(frozen=True, slots=True)
class Unit:
    """One checkpoint: a file, or a folder with all its files (sorted by path)."""

    rel: str
    run: str
    step: int | None
    kind: UnitKind
    files: tuple[FileState, ...] = ()
    role: Role = "checkpoint"

    @property
    def size(self) -> int:
        """Bytes in the unit's files."""
        return sum(f.size for f in self.files)

    @property
    def mtime_ns(self) -> int:
        """When the unit was last written: its newest file."""
        return max((f.mtime_ns for f in self.files), default=0)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every file of the unit, relative to the root."""
        return tuple(f.rel for f in self.files)

    def member(self, rel: str) -> str:
        """`rel` relative to a folder unit (the file's own name for a file unit)."""
        return rel[len(self.rel) + 1 :] if self.kind == "folder" else rel.rsplit("/", 1)[-1]

    def get(self, member: str) -> FileState | None:
        """The file at `member` (relative to the folder), if the unit has it."""
        rel = f"{self.rel}/{member}" if self.kind == "folder" else self.rel
        return next((f for f in self.files if f.rel == rel), None)


def locate(rel: str, layout: Layout) -> Unit | None:
    """The unit `rel` belongs to under `layout` (without its files), or None when the layout does not
    select it.

    Folder layouts: the outermost path component that names a unit folder makes the unit; a file below
    a staging folder (NAME.part/) belongs to no unit. Beside the units, aliases and tag files are
    units of their own with no step.
    """
    parts = rel.split("/")
    name = parts[-1]
    if layout.folders:
        for i, part in enumerate(parts[:-1]):
            if layout.is_staging_name(part):
                return None
            if layout.is_unit_name(part):
                if not layout.is_member_name(name):
                    return None
                return Unit("/".join(parts[: i + 1]), "/".join(parts[:i]), layout.step_of(part), "folder")
    if layout.is_extra_name(name):
        return Unit(rel, dirname(rel), None, "file", role="alias" if name in layout.aliases else "tag")
    if not layout.folders and layout.is_unit_name(name):
        return Unit(rel, dirname(rel), layout.step_of(name), "file")
    return None


def recorded_as(rel: str, layout: Layout, members: int = 1) -> dict[str, Any]:
    """What the file at `rel` is, as its manifest entry records it (ManifestEntry.layout, unit, members, role)."""
    place = locate(rel, layout)
    return {
        "layout": layout.name,
        "unit": place.rel if place is not None and place.kind == "folder" else "",
        "members": members,
        "role": "other" if place is None else "" if place.role == "checkpoint" else place.role,
    }


def run_and_step(rel: str, layout: Layout, step_regex: re.Pattern[str]) -> tuple[str, int | None]:
    """(run, step) of a file: a folder unit member's are its unit's (the unit's parent folder, the step in
    the unit's name); any other file's are its own folder and the step in its own name."""
    if layout.folders and (place := locate(rel, layout)) is not None and place.kind == "folder":
        return place.run, place.step
    return dirname(rel), step_of(rel, step_regex)


def unit_of(rel: str, layout: Layout) -> str | None:
    """The unit a path touches, for routing a watch event (or a unit path) to what must be judged again:
    with folder units, the outermost unit folder at or above `rel` (none below a staging folder), else a
    tag or alias file; with file units, the file itself when the layout selects it."""
    place = (locate(rel + "/", layout) if layout.folders else None) or locate(rel, layout)  # ("rel/": at)
    return place.rel if place is not None else None


def group_units(files: Iterable[FileState], layout: Layout) -> dict[str, Unit]:
    """Every unit of a listing, by unit path. Files the layout does not select are left out."""
    members: dict[str, list[FileState]] = {}
    places: dict[str, Unit] = {}
    for state in files:
        if (place := locate(state.rel, layout)) is not None:
            places.setdefault(place.rel, place)
            members.setdefault(place.rel, []).append(state)
    return {
        rel: dataclasses.replace(p, files=tuple(sorted(members[rel], key=lambda f: f.rel))) for rel, p in places.items()
    }


UnitIdentity = tuple[tuple[str, int, int, int, int], ...]


def unit_identity(files: Iterable[FileState]) -> UnitIdentity:
    """What must stay the same for a folder unit to count as unchanged: every file's path and identity
    (a file added, removed or rewritten changes it)."""
    return tuple(sorted((f.rel, *f.identity) for f in files))


@dataclass(frozen=True, slots=True)
class NamingWarning:
    """Checkpoint-like files the layout will not handle as the user likely expects; one per pattern."""

    kind: Literal["no_step", "not_selected"]
    pattern: str  # the file name pattern it is about (a layout's pattern, or a LOOKALIKES one)
    path: str  # the first such file seen
    message: str  # what it means, and which layout or key would change it


def naming_warnings(snapshot: Snapshot, layout: Layout) -> list[NamingWarning]:
    """Checkpoints from whose names no step can be extracted (retention would silently never prune
    them), and files the layout does not select that look like checkpoints (never mirrored): one
    warning per file name pattern, naming the first path."""
    found: dict[tuple[str, str], NamingWarning] = {}
    no_step = {
        place.rel
        for rel in snapshot.files
        if (place := locate(rel, layout)) is not None and place.role == "checkpoint" and place.step is None
    }
    for rel in sorted(no_step):
        pattern = layout.pattern_of(rel.rsplit("/", 1)[-1])
        found.setdefault(
            ("no_step", pattern),
            NamingWarning(
                "no_step",
                pattern,
                rel,
                f"{rel}: no step in its name by '{layout.step_pattern}' (layout {layout.name!r}): mirrored, but "
                f"retention never prunes it or anything named {pattern!r} without a step; check `layout`"
                + (" or prune.step_pattern" if layout.name in ("torch", "custom") else ""),
            ),
        )
    for pattern, rel in sorted(snapshot.lookalikes.items()):
        found.setdefault(
            ("not_selected", pattern),
            NamingWarning(
                "not_selected",
                pattern,
                rel,
                f"{rel}: looks like a checkpoint ({pattern}) but layout {layout.name!r} does not select it, so it is "
                f"never mirrored; {LOOKALIKES[pattern]} would select it"
                if pattern in LOOKALIKES
                else f"{rel}: a file named by pattern {pattern!r}, but layout {layout.name!r} mirrors folders "
                "so named; no unit rule ever mirrors a file beside them"
                + (
                    '; layout = "megatron" mirrors this tracker after the iteration it names'
                    if rel.endswith(MEGATRON_TRACKER)
                    else ""
                ),
            ),
        )
    return list(found.values())


@dataclass(frozen=True, slots=True)
class Completeness:
    """Whether a unit is whole, and what shows it (or what is missing)."""

    complete: bool
    why: str  # for a person: what is missing, or what proved it whole


def reads_needed(unit: Unit, layout: Layout) -> tuple[str, ...]:
    """The small files the shell must read for `completeness`: whole (up to MAX_READ_BYTES), a safetensors
    file only up to the end of its header (mirrord.formats.safetensors_head)."""
    if unit.kind != "folder" or unit.role != "checkpoint":
        return ()
    weights = tuple(f.rel for f in unit.files if f.rel.endswith((".safetensors", ".index.json")))
    state_file = {"dcp": METADATA_NAME, "hf": HF_STATE}.get(layout.rule)
    if state_file is not None:
        state = (f"{unit.rel}/{state_file}",) if unit.get(state_file) is not None else ()
        return state + weights if layout.rule == "hf" else state
    if layout.rule == "deepspeed" and layout.tag_file:
        return (f"{unit.run}/{layout.tag_file}" if unit.run else layout.tag_file,)
    return weights if layout.rule == "hf_model" else ()


HF_BIN_WEIGHTS = frozenset({"pytorch_model.bin", "adapter_model.bin"})
HF_ENGINE_WEIGHTS = ("global_step", "pytorch_model_fsdp")  # DeepSpeed's and FSDP's weight folders in a checkpoint
Quiet = Callable[[Unit, bool], bool]  # (folder unit, only a pause can tell) -> unchanged long enough


def completeness(
    unit: Unit,
    layout: Layout,
    quiet: Quiet = lambda _unit, _guess: True,
    reads: Mapping[str, bytes | None] | None = None,
    recorded: frozenset[str] | None = None,
) -> Completeness:
    """Whether `unit` is whole on the primary, by its layout's rule (see mirrord.layouts.Rule).

    Evidence first (the saver's last file, an index or tag naming what must be there), then `quiet`: the
    whole folder unchanged for copy.settle_seconds, or for unit.settle_seconds where there is no evidence
    and the pause is a guess. `reads` holds the bytes of the files `reads_needed` named (None: could not be
    read); `recorded`: the member names of the run's previous checkpoint on the mirror (accelerate, Megatron's
    ranks), which this one must have too.
    """
    reads = reads or {}
    if unit.kind == "file" or unit.role != "checkpoint":
        ok = quiet(unit, False)
        return Completeness(ok, "settled" if ok else "still being written")
    if layout.rule == "dcp":  # DCP renames .metadata into place last: the commit point, no pause needed
        return _dcp_complete(unit, reads.get(f"{unit.rel}/{METADATA_NAME}"))
    evidence = _evidence(unit, layout, reads, recorded)
    if evidence is not None and not evidence.complete:
        return evidence
    if not quiet(unit, evidence is None):
        return Completeness(False, "still being written: a file or the file list changed within the settle time")
    return evidence or Completeness(
        True,
        "unchanged for unit.settle_seconds (a guess: nothing says it is whole; "
        "name the saver's last file as unit.complete_marker)",
    )


def _evidence(
    unit: Unit, layout: Layout, reads: Mapping[str, bytes | None], recorded: frozenset[str] | None
) -> Completeness | None:
    """What the saver's own files say (None: nothing, only a pause can tell). DeepSpeed's and Megatron's
    ranks, and accelerate's custom_checkpoint_<i>.pkl (one per registered object: how many is written
    nowhere), vary with the run: its previous checkpoint on the mirror (`recorded`) says which to expect."""
    if layout.rule == "marker":
        present = unit.get(layout.complete_marker) is not None
        return Completeness(
            present, f"{layout.complete_marker} present" if present else f"no {layout.complete_marker} marker yet"
        )
    if layout.rule == "hf":
        return _hf_complete(unit, reads)
    if layout.rule == "hf_model":
        return hf_model_complete(unit, reads)
    names = {unit.member(f.rel) for f in unit.files}
    if layout.rule == "deepspeed":
        verdict = _deepspeed_complete(unit, layout, reads.get(reads_needed(unit, layout)[0]))
    elif layout.rule != "accelerate":
        return None
    elif not any(ACCELERATE_STATE.fullmatch(name) for name in names):
        return Completeness(False, "no random_states_N.pkl yet (save_state writes it after the model state)")
    elif recorded is None:
        return None  # the run's first checkpoint: a guess
    else:
        verdict = Completeness(True, "random_states and every file of the run's previous checkpoint present")
    missing = sorted(recorded - names) if recorded and verdict.complete else []
    return Completeness(False, f"{missing[0]} missing (the run's previous checkpoint has it)") if missing else verdict


def dcp_needs(metadata: bytes | None) -> dict[str, int] | Completeness:
    """What a DCP `.metadata` lists (member -> bytes it needs), or why the folder cannot be judged
    complete from it (unreadable or not a DCP metadata file): one reading for every rule that trusts it."""
    if metadata is None:
        return Completeness(False, f"{METADATA_NAME} could not be read")
    try:
        return storage_references(metadata)
    except MetadataError as exc:
        return Completeness(False, f"{METADATA_NAME}: {exc}")


def lacking(needs: Mapping[str, int], sizes: Mapping[str, int], missing: str) -> Completeness | None:
    """The first file a `.metadata` lists (`needs`: member -> bytes) that `sizes` (member -> bytes held)
    lacks (`missing` says how, after the member's name) or holds short of its bytes; None: all there."""
    for member, size in sorted(needs.items()):
        if (have := sizes.get(member)) is None:
            return Completeness(False, f"{METADATA_NAME} {missing.format(member)}")
        if have < size:
            return Completeness(False, f"{member} has {have} bytes, {METADATA_NAME} needs {size}")
    return None


def _dcp_complete(unit: Unit, metadata: bytes | None) -> Completeness:
    if unit.get(METADATA_NAME) is None:
        return Completeness(False, f"no {METADATA_NAME} yet (dcp.save writes it last)")
    needed = dcp_needs(metadata)
    if isinstance(needed, Completeness):
        return needed
    sizes = {unit.member(f.rel): f.size for f in unit.files}
    return lacking(needed, sizes, "references {}, which is missing") or Completeness(
        True, f"{METADATA_NAME} present, its {len(needed)} file(s) whole"
    )


def _hf_complete(unit: Unit, reads: Mapping[str, bytes | None]) -> Completeness:
    if unit.get(HF_STATE) is None:
        return Completeness(False, f"no {HF_STATE} yet (the Trainer writes it last)")
    if (state := reads.get(f"{unit.rel}/{HF_STATE}")) is None:
        return Completeness(False, f"{HF_STATE} could not be read")
    try:
        if not isinstance(json.loads(state), dict):
            return Completeness(False, f"{HF_STATE} is not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        return Completeness(False, f"{HF_STATE} does not parse: {exc}")
    weights = _hf_weights(unit, reads)
    return Completeness(True, f"settled, {HF_STATE} parses, {weights.why}") if weights.complete else weights


def _hf_weights(unit: Unit, reads: Mapping[str, bytes | None]) -> Completeness:
    """The Trainer saves the model before its state: a folder whose trainer_state.json parses but whose weights
    are missing lost them (a rotation's rmtree under way, a save killed inside it): it is not a checkpoint.
    Weights: the safetensors file(s) whole by their headers and index, pytorch_model.bin (or its index's shards),
    an adapter's, or the folder a DeepSpeed or FSDP engine saves them into."""
    safetensors = hf_model_complete(unit, reads)
    if safetensors is not None:
        return safetensors
    names = {unit.member(f.rel) for f in unit.files}
    for index in sorted(n for n in names if n.endswith(".bin.index.json")):
        try:
            needed = set(json.loads(reads.get(f"{unit.rel}/{index}") or b"")["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return Completeness(False, f"{index} does not parse as a weight index")
        if missing := sorted(needed - names):
            return Completeness(False, f"the index names {missing[0]}, which is missing")
    if names & HF_BIN_WEIGHTS or any(n.startswith(HF_ENGINE_WEIGHTS) for n in names):
        return Completeness(True, "its weights present")
    return Completeness(False, "no model weights (model.safetensors, pytorch_model.bin or an index and its shards)")


def _deepspeed_complete(unit: Unit, layout: Layout, tag: bytes | None) -> Completeness:
    name = unit.rel.rsplit("/", 1)[-1]
    if tag is None:
        return Completeness(False, f"no {layout.tag_file} tag file yet")
    text = tag.decode("utf-8", "replace").strip()
    if text == name:
        return Completeness(True, f"named by {layout.tag_file}")
    tagged = int(text) if text.isdigit() else layout.step_of(text)  # Megatron's tracker holds the number
    if tagged is not None and unit.step is not None and unit.step <= tagged:
        return Completeness(True, f"older than {text}, which {layout.tag_file} names")
    return Completeness(False, f"{layout.tag_file} names {text!r}, not this folder yet")


def safetensors_needs(head: bytes | None) -> int | None:
    """The bytes a safetensors file needs by its header (8-byte length, JSON header, data up to the last
    tensor's end offset), from its first bytes; None when they are not a safetensors header."""
    if head is None or len(head) < 8:
        return None
    length = int.from_bytes(head[:8], "little")
    try:
        header = json.loads(head[8 : 8 + length])
        return (
            8 + length + max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError):
        return None


def hf_model_complete(unit: Unit, reads: Mapping[str, bytes | None]) -> Completeness | None:
    """save_pretrained writes its shards, then the index naming them (`*.index.json`): whole when the index
    lists shards that are all present with the bytes their headers need, or the one model file is whole.
    None (a guess) for a folder with no safetensors file at all."""
    indexes = [f for f in unit.files if f.rel.endswith(".safetensors.index.json")]
    shards = {unit.member(f.rel) for f in unit.files if f.rel.endswith(".safetensors")}
    if not shards and not indexes:
        return None
    needed: set[str] = set()
    for index in indexes:
        try:
            needed |= set(json.loads(reads.get(index.rel) or b"")["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return Completeness(False, f"{unit.member(index.rel)} does not parse as a weight index")
    if not indexes and any("-of-" in name for name in shards):
        return Completeness(False, "sharded save: no index yet (save_pretrained writes it last)")
    for name in sorted(needed | shards):
        state = unit.get(name)
        if state is None:
            return Completeness(False, f"the index names {name}, which is missing")
        size = safetensors_needs(reads.get(state.rel))
        if size is None or state.size < size:
            return Completeness(False, f"{name} is not whole yet ({state.size} bytes, its header needs {size})")
    return Completeness(
        True, f"{len(needed | shards)} safetensors file(s) whole" + (", named by the index" if indexes else "")
    )
