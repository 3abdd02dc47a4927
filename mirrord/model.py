"""Plain, frozen records that flow between the scanner, the planners and the executors."""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from posixpath import dirname


@dataclass(frozen=True, slots=True)
class FileState:
    """What lstat said about one file, relative to its root."""

    rel: str
    size: int
    mtime_ns: int
    ino: int = 0
    dev: int = 0
    mode: int = stat.S_IFREG | 0o644

    @property
    def is_regular(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def run(self) -> str:
        """The run a checkpoint belongs to: its folder relative to the root ('' for the root itself)."""
        return dirname(self.rel)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One listing of a volume. `errors` non-empty means the view is partial: never prune from it."""

    files: dict[str, FileState] = field(default_factory=dict)
    partials: dict[str, FileState] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (rel, why) for symlinks, devices, FIFOs ...

    @property
    def complete(self) -> bool:
        return not self.errors


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """The resume record of one mirrored artifact: what it must be to count as intact."""

    path: str
    size: int
    algo: str
    digest: str
    source_mtime_ns: int
    step: int | None
    mirrored_at: float
    # The mtime the mirror actually stored (a filesystem may clamp or round what it is given, e.g.
    # ext4 with 128-byte inodes stops at 2038); None in records made before it was kept.
    mirror_mtime_ns: int | None = None

    @property
    def run(self) -> str:
        return dirname(self.path)


@dataclass(frozen=True, slots=True)
class CopyJob:
    """A file to copy, and why the planner chose it."""

    rel: str
    size: int
    mtime_ns: int
    step: int | None
    why: str  # new | changed | mirror_missing | mirror_mismatch | unrecorded

    @property
    def run(self) -> str:
        return dirname(self.rel)


@dataclass(frozen=True, slots=True)
class CopyResult:
    rel: str
    size: int
    algo: str
    digest: str
    source_mtime_ns: int
    seconds: float
    mirror_mtime_ns: int | None = None  # what the mirror stored (see ManifestEntry)


def step_of(rel: str, step_regex: re.Pattern[str]) -> int | None:
    """The training step in a checkpoint's file name, or None (files with no step are never pruned)."""
    match = step_regex.search(rel.rsplit("/", 1)[-1])
    if match is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        return None
