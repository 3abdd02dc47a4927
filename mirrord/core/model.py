"""Plain, frozen records of what is on disk and in the manifest, as the scanner, the planners and the
executors pass them (the records of copying itself are mirrord.core.jobs)."""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from posixpath import dirname

from mirrord.formats.verdicts import OK, PASSING, RENAMED

# Versions of a name kept beside its verified copy, in a folder no listing enters (a dot name). Their
# manifest entries carry a role, so that no reader takes one for a checkpoint: PENDING, a newer copy whose
# source gave no evidence yet that it is whole (at VERSIONS/rel); PREVIOUS, a copy a promoted one moved aside
# (at VERSIONS/rel@seq, its own recording sequence).
VERSIONS, PENDING, PREVIOUS = ".mirrord-versions", "pending", "previous"


@dataclass(frozen=True, slots=True)
class FileState:
    """What lstat said about one file, relative to its root."""

    rel: str
    size: int
    mtime_ns: int
    ino: int = 0
    dev: int = 0
    mode: int = stat.S_IFREG | 0o644
    ctime_ns: int = 0

    @property
    def identity(self) -> tuple[int, int, int, int]:
        """What must stay the same for the file to count as unchanged: a rewrite moves ctime at least."""
        return (self.ino, self.size, self.mtime_ns, self.ctime_ns)

    @property
    def is_regular(self) -> bool:
        """A regular file (not a folder, link or device)."""
        return stat.S_ISREG(self.mode)

    @property
    def run(self) -> str:
        """The run a checkpoint belongs to: its folder relative to the root ('' for the root itself)."""
        return self.rel.rpartition("/")[0]  # posixpath.dirname of a canonical rel path, a third of its cost


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One listing of a volume. `errors` non-empty means the view is partial: never prune from it."""

    files: dict[str, FileState] = field(default_factory=dict)
    partials: dict[str, FileState] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (rel, why) for symlinks, devices, FIFOs ...
    # Folder units being published (NAME.part/ directories), by path: never entered, swept when dead.
    staging: dict[str, FileState] = field(default_factory=dict)
    # Files the layout did not select that look like checkpoints: the first one seen per
    # mirrord.layouts.LOOKALIKES pattern (pattern -> rel), for a warning.
    lookalikes: dict[str, str] = field(default_factory=dict)
    versions: dict[str, FileState] = field(default_factory=dict)  # the files below VERSIONS (a mirror's)

    @property
    def complete(self) -> bool:
        """The listing saw the whole tree (no errors): only then may absence mean deletion."""
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
    # The format validator's verdict on the source ("ok" or "unchecked"); None in entries written
    # before validation existed. An entry is only ever recorded for a source that passed.
    validation: str | None = None
    # The published copy's inode and ctime right after it was recorded (0 when unknown): while the file
    # still has them, and the recorded size and stored mtime, its recorded hash holds without re-reading.
    mirror_ino: int = 0
    mirror_ctime_ns: int = 0
    # The node that recorded it, in a prefix several nodes share ("" on a local mirror): its size and
    # mtime speak for that node's source only (mirrord.core.nodes).
    node: str = ""
    # What the file is a part of, so that a reader needs no config to tell: the layout that named it
    # ("" in records made before the record said), the folder unit it is a member of ("": a unit of its
    # own), how many files that unit has (all recorded by one change), and "alias" or "tag" for a file kept
    # beside the checkpoints that is none ("": a checkpoint), PENDING or PREVIOUS for a version (VERSIONS).
    layout: str = ""
    unit: str = ""
    members: int = 1
    role: str = ""
    # The source's identity when it was copied (0: not recorded): a file replaced by other bytes with the
    # same size and mtime (`cp -p`, `rsync -a`) has another inode or ctime.
    source_dev: int = 0
    source_ino: int = 0
    source_ctime_ns: int = 0
    # The order of truth, which no clock step, `touch` or mtime changes (0: recorded before it was kept).
    # `seq`: one more than any record before it on this mirror (every file of a unit has its unit's; the same
    # bytes copied again keep theirs). `seen`: the last `seq` recorded when its source was first listed: a
    # lower step seen after a higher one was recorded is a rollback, a backlog copied newest first is not.
    seq: int = 0
    seen: int = 0

    @property
    def run(self) -> str:
        """The run folder of the recorded file's unit."""
        return dirname(self.unit or self.path)

    @property
    def stored_mtime_ns(self) -> int:
        """The mtime the mirror stored (records from before it was kept: the source's)."""
        return self.source_mtime_ns if self.mirror_mtime_ns is None else self.mirror_mtime_ns

    def unchanged(self, state: FileState) -> bool:
        """The mirror file is, by stat, exactly the one recorded (needs the identity recorded)."""
        return bool(self.mirror_ino) and state.identity == (
            self.mirror_ino,
            self.size,
            self.stored_mtime_ns,
            self.mirror_ctime_ns,
        )


def version_key(rel: str, seq: int = 0) -> str:
    """Where a version of `rel` is kept: the pending one, or (seq) one moved aside by a promotion."""
    return f"{VERSIONS}/{rel}@{seq}" if seq else f"{VERSIONS}/{rel}"


def versioned(entry: ManifestEntry) -> str:
    """The name a version entry is a version of."""
    rel = entry.path.removeprefix(VERSIONS + "/")
    return rel.rpartition("@")[0] if entry.role == PREVIOUS else rel


def entry_passed(entry: ManifestEntry) -> bool:
    """Recorded with a passing validator verdict (entries from before validation existed count)."""
    return entry.validation is None or entry.validation in PASSING


def entry_whole(entry: ManifestEntry) -> bool:
    """Passed with evidence that it is whole: a validator's ok, a commit by rename, or a record from before
    verdicts existed. An `unchecked` file written in place may be torn: `latest` never names it alone."""
    return entry.validation is None or entry.validation in (OK, RENAMED)


def step_of(rel: str, step_regex: re.Pattern[str]) -> int | None:
    """The training step in a checkpoint's file name, or None (files with no step are never pruned)."""
    match = step_regex.search(rel.rsplit("/", 1)[-1])
    if match is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        return None
