"""Trainer layouts: how a training stack names its checkpoints, and when one is whole.

A checkpoint *unit* is what a resume needs: one file (`step_100.pt`, `epoch=4-step=20.ckpt`) or one
folder (`checkpoint-50/` of the Hugging Face Trainer, `step_8/` of torch.distributed.checkpoint,
`global_step100/` of DeepSpeed). A Layout says, for one top-level `layout` key, which names are units,
where the step is, which other files ride along (Lightning's `last.ckpt` alias, DeepSpeed's `latest`
tag file) and which rule tells that a unit is complete on the primary. Pure: names in, answers out.
On the config's floor, below the core: the config builds one (Config.rules), the core and the store read it.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from mirrord.formats.dcpmeta import METADATA_NAME

LAYOUTS = ("torch", "lightning", "hf", "hf_model", "accelerate", "dcp", "deepspeed", "megatron", "custom")
TEMP_SUFFIXES = (".part", ".tmp")  # never a finished name (ours, and the usual writer's convention)


@functools.lru_cache(maxsize=64)
def name_matcher(patterns: tuple[str, ...]) -> Callable[[str], object]:
    """All patterns as one test, true for a match (fnmatchcase semantics), which a scan of 1,000,000 files
    feels: `*.pt`-style patterns as one suffix test, others as one compiled regex."""
    if not patterns:
        return lambda name: False
    if all(p.startswith("*") and not any(c in p[1:] for c in "*?[") for p in patterns):
        suffixes = tuple(p[1:] for p in patterns)
        return lambda name: name.endswith(suffixes)
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


UnitKind = Literal["file", "folder"]
# How completeness on the primary is judged (see mirrord.core.units.completeness). A folder unit must also
# be quiet: its whole listing unchanged for copy.settle_seconds (unit.settle_seconds under "settle").
#   settle      nothing but the pause (a guess)
#   marker      the marker file (unit.complete_marker) present in the folder
#   dcp         .metadata present, every file it references present with its size (no pause needed)
#   hf          trainer_state.json present and parsing as JSON
#   hf_model    the index's shards (or the one model file) present with the bytes their headers need
#   accelerate  random_states_N.pkl present, and every file the run's previous checkpoint had
#   deepspeed   the run's tag file (`latest`, Megatron's tracker) names this folder or a later step
Rule = Literal["settle", "marker", "dcp", "hf", "hf_model", "accelerate", "deepspeed"]

HF_STATE = "trainer_state.json"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Layout:
    """The naming rules of one training stack. Build with `layout_for`."""

    name: str
    kind: UnitKind
    # file units: names of checkpoint files; folder units: names of unit folders (fnmatch patterns)
    patterns: tuple[str, ...]
    step_pattern: str  # one group: the step; searched in a unit's own name (file or folder)
    rule: Rule = "settle"
    complete_marker: str = ""
    aliases: tuple[str, ...] = ()  # mirrored, never a unit: no step, never counted by retention
    tag_file: str = ""  # a file beside the unit folders naming the newest one; mirrored after it
    step_regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _matches: Callable[[str], object] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_regex", re.compile(self.step_pattern))
        object.__setattr__(self, "_matches", name_matcher(self.patterns))

    @property
    def folders(self) -> bool:
        """Whether checkpoints are folders (hf, dcp, ...) rather than single files."""
        return self.kind == "folder"

    def is_unit_name(self, name: str) -> bool:
        """`name` (one path component) names a unit: a checkpoint file, or a unit folder."""
        return not name.startswith(".") and not name.endswith(TEMP_SUFFIXES) and bool(self._matches(name))

    def is_staging_name(self, name: str) -> bool:
        """A folder unit being published on the mirror (`checkpoint-50.part/`), or an old copy set aside
        while a new one took its name (`checkpoint-50.old.part/`)."""
        return (
            self.folders
            and name.endswith(".part")
            and (self.is_unit_name(name.removesuffix(".part")) or self.is_unit_name(name.removesuffix(".old.part")))
        )

    def is_extra_name(self, name: str) -> bool:
        """A file mirrored beside the units that is not one itself (alias, tag file)."""
        return name in self.aliases or (bool(self.tag_file) and name == self.tag_file)

    def pattern_of(self, name: str) -> str:
        """The first of the layout's patterns that selects `name` (a unit's name); the name itself if none."""
        return next((p for p in self.patterns if fnmatch.fnmatchcase(name, p)), name)

    def is_alias(self, rel: str) -> bool:
        """`rel` is an alias file (`last.ckpt`): mirrored beside the units, never one itself."""
        return rel.rsplit("/", 1)[-1] in self.aliases

    @staticmethod
    def is_member_name(name: str) -> bool:
        """A file inside a unit folder that belongs to the unit: every file but a temp name (dot names
        included: DCP's `.metadata` is what makes its folder loadable)."""
        return not name.endswith(TEMP_SUFFIXES)

    def step_of(self, name: str) -> int | None:
        """The step number in `name` (the step pattern's first group), or None."""
        match = self.step_regex.search(name)
        try:
            return int(match.group(1)) if match else None
        except (ValueError, IndexError):
            return None

    def describe(self) -> list[str]:
        """The effective rules, one line each (for `check-config`)."""
        what = "files" if self.kind == "file" else "folders"
        lines = [
            f"layout = {self.name!r}: a checkpoint is one of the {what} named {list(self.patterns)}",
            f"step: the first group of '{self.step_pattern}' in the {what[:-1]}'s name; "
            "units with no step are mirrored, never pruned",
        ]
        if self.folders:
            lines.append(
                "a folder is mirrored whole: staged as NAME.part/ on the mirror, renamed when every "
                "file is copied and fsynced; every file in it is mirrored (dot names too)"
            )
        rules = {
            "settle": "complete when no file and not the file list changed for unit.settle_seconds: a GUESS "
            "(name the file the saver writes last as unit.complete_marker to know instead)",
            "marker": f"complete when {self.complete_marker!r} is present",
            "dcp": f"complete when {METADATA_NAME} is present and every file it references holds its bytes",
            "hf": f"complete when {HF_STATE} is present and parses",
            "hf_model": "complete when the *.index.json lists shards that are all present with the bytes their "
            "safetensors headers need (or the one model file is whole)",
            "accelerate": "complete when random_states_N.pkl and every file of the run's previous mirrored "
            "checkpoint are present (custom_checkpoint_N.pkl: how many is written nowhere; the "
            "run's first checkpoint waits unit.settle_seconds, a guess)",
            "deepspeed": f"complete when the {self.tag_file!r} tag file names it (or a later step)",
        }
        lines.append(
            "complete when renamed into place, or unchanged for copy.settle_seconds"
            if not self.folders
            else rules[self.rule]
            + ("" if self.rule in ("settle", "dcp") else ", and no file changed for copy.settle_seconds")
        )
        if self.aliases:
            lines.append(f"aliases {list(self.aliases)}: mirrored, never counted by retention")
        if self.tag_file:
            lines.append(f"tag file {self.tag_file!r}: mirrored after the folder it names")
        return lines


# The layouts whose names are fixed: kind, patterns, step pattern, rule, marker, aliases, tag file.
_FIXED: dict[str, tuple[UnitKind, tuple[str, ...], str, Rule, str, tuple[str, ...], str]] = {
    "lightning": ("file", ("*.ckpt",), r"step=(\d+)", "settle", "", ("last.ckpt",), ""),
    "hf": ("folder", ("checkpoint-[0-9]*",), r"^checkpoint-(\d+)$", "hf", "", (), ""),
    "dcp": ("folder", ("step_[0-9]*", "step-[0-9]*"), r"^step[_-](\d+)$", "dcp", "", (), ""),
    "deepspeed": ("folder", ("global_step[0-9]*",), r"^global_step(\d+)$", "deepspeed", "", (), "latest"),
    "accelerate": ("folder", ("checkpoint_[0-9]*",), r"^checkpoint_(\d+)$", "accelerate", "", (), ""),
    "megatron": ("folder", ("iter_[0-9]*",), r"^iter_(\d+)$", "deepspeed", "", (), MEGATRON_TRACKER),
}


@functools.lru_cache(maxsize=32)
def layout_for(
    name: str,
    patterns: tuple[str, ...] = ("*.pt",),
    step_pattern: str = r"step_(\d+)",
    unit: UnitKind = "file",
    complete_marker: str = "",
) -> Layout:
    """The Layout called `name`. `patterns`, `step_pattern`, `unit` and `complete_marker` are the
    config's: used by "torch" (patterns, step_pattern) and "custom" (all four), fixed by the others."""
    if name in _FIXED:
        return Layout(name, *_FIXED[name])
    if name == "torch":
        return Layout("torch", "file", patterns, step_pattern)
    if name == "hf_model":
        custom = patterns != ("*.pt",)
        return Layout(
            "hf_model",
            "folder",
            patterns if custom else ("checkpoint-[0-9]*", "step_[0-9]*", "step-[0-9]*"),
            step_pattern if step_pattern != r"step_(\d+)" else r"[-_](\d+)$",
            rule="hf_model",
        )
    if name == "custom":
        rule: Rule = "marker" if complete_marker else "settle"
        return Layout("custom", unit, patterns, step_pattern, rule, complete_marker)
    raise ValueError(f"unknown layout {name!r}; one of {', '.join(LAYOUTS)}")


# Names that look like another training stack's checkpoints, and the setting that would select them:
# files a layout does not select but whose names say "checkpoint" are warned about (once per pattern).
LOOKALIKES: dict[str, str] = {
    "checkpoint-N/": 'layout = "hf"',
    "global_stepN/": 'layout = "deepspeed"',
    "*.distcp": 'layout = "dcp"',
    "*.ckpt": 'layout = "lightning"',
    "*.safetensors": 'layout = "hf" (checkpoint-N/ folders), or layout = "custom" with patterns = ["*.safetensors"]',
    "*.pt": 'layout = "torch" (or "custom") with "*.pt" in patterns',
    "*.pth": 'layout = "torch" (or "custom") with "*.pth" in patterns',
}
_LOOKALIKE_FOLDER = re.compile(r"(checkpoint-|global_step)\d+")  # LOOKALIKES' checkpoint-N/, global_stepN/
_LOOKALIKE_SUFFIXES = tuple(p[1:] for p in LOOKALIKES if p.startswith("*"))  # (".distcp", ...)


def lookalike_folder(rel_dir: str) -> str | None:
    """The LOOKALIKES pattern every file below `rel_dir` matches by its folders (`checkpoint-N/`), or None."""
    match = next(filter(None, map(_LOOKALIKE_FOLDER.fullmatch, rel_dir.split("/"))), None)
    return match.group(1) + "N/" if match else None


def lookalike_name(name: str, folder_pattern: str | None = None) -> str | None:
    """The LOOKALIKES pattern of a file named `name` in a folder whose lookalike_folder is
    `folder_pattern`, or None. Hidden and temp names never look like a checkpoint."""
    if name.startswith(".") or name.endswith(TEMP_SUFFIXES):
        return None
    if folder_pattern is not None:
        return folder_pattern
    return next(("*" + s for s in _LOOKALIKE_SUFFIXES if name.endswith(s)), None)


def never_matching(layout: Layout) -> list[str]:
    """Patterns that can never select anything, and a folder rule that can only guess, each with why (for
    `check-config`)."""
    problems = []
    for pattern in layout.patterns:
        if pattern.startswith("."):
            problems.append(
                f"pattern {pattern!r} can never match: a {layout.kind} whose name starts with '.' is never "
                f"a checkpoint in layout {layout.name!r} (hidden names are skipped)"
            )
        elif pattern.endswith(TEMP_SUFFIXES):
            problems.append(
                f"pattern {pattern!r} can never match: names ending in {' or '.join(TEMP_SUFFIXES)} "
                "are files still being written"
            )
    if layout.folders and layout.rule == "settle":
        problems.append(
            "folder units without unit.complete_marker: their completeness is a GUESS (nothing in the "
            "folder changed for unit.settle_seconds); name the file your saver writes last as "
            "unit.complete_marker"
        )
    if layout.folders and layout.rule == "marker" and layout.complete_marker.endswith(TEMP_SUFFIXES):
        problems.append(f"unit.complete_marker {layout.complete_marker!r} can never count: it is a temp name")
    return problems
