"""What the planners ask the copier for and what a copy reports: the records of copying, apart from the
model of what is on disk (mirrord.core.model), which a read-only command (`mirrord latest`) loads alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CopyJob:
    """A file to copy, and why the planner chose it."""

    rel: str
    size: int
    mtime_ns: int
    step: int | None
    why: str  # new | changed | replaced | mirror_missing | mirror_mismatch | unrecorded | part (this node's share)
    # A folder unit (mirrord.core.units): `rel` is the folder, these are its files, published together.
    members: tuple[str, ...] = ()
    # An alias (Lightning's last.ckpt): mirrored checkpoints of its run recorded with its size, newest
    # first. If its bytes hash to one of theirs, it is published from that copy, never written again.
    twins: tuple[str, ...] = ()
    # This node's part of a folder unit whose other files are on other nodes (s3.units_span_nodes):
    # uploaded and recorded as a contribution (mirrord.core.contributions), never as the whole unit.
    part: bool = False
    # The writer renamed the file into place (seen by a watch event): whole by construction. An unchecked
    # format is then recorded "renamed", which retention takes as evidence of wholeness.
    committed: bool = False
    # The manifest's last recording sequence when the job was first queued (ManifestEntry.seen).
    seen: int = 0

    @property
    def run(self) -> str:
        """The run folder of the job's file or unit."""
        return self.rel.rpartition("/")[0]  # posixpath.dirname of a canonical rel path

    @property
    def paths(self) -> tuple[str, ...]:
        """Every file this job publishes."""
        return self.members or (self.rel,)

    def waiting_since(self, now: float) -> float:
        """Since when (wall clock) the job's file has lacked its mirror copy: its mtime, or `now` when the
        mtime is unset or in the future (a clock that lies is no evidence of age). Every lag is read from
        this one rule: the daemon's gauge and `mirrord status`."""
        mtime = self.mtime_ns / 1e9
        return mtime if 0 < mtime <= now else now


@dataclass(frozen=True, slots=True)
class CopyResult:
    """One verified copy: what was published, its digest and how long it took."""

    rel: str
    size: int
    algo: str
    digest: str
    source_mtime_ns: int
    seconds: float
    mirror_mtime_ns: int | None = None  # what the mirror stored (see ManifestEntry)
    validation: str = "unchecked"  # the validator's verdict on the source: ok | unchecked
    validation_detail: str = ""
    source: tuple[int, int, int] = (0, 0, 0)  # the source's (device, inode, ctime) as copied (ManifestEntry)
    wrote: bool = True  # False: nothing was written, the source holds the bytes recorded (Engine.stage)
