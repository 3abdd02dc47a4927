"""The words mirrord reports with: volumes, guard vetoes, copy results, prune refusals.

Each is a `StrEnum`, so a member is the plain string that reaches logs, JSON and metric labels, and the
metric label sets are derived from these classes (mirrord.obs.metrics) instead of being typed again.
"""

from __future__ import annotations

from enum import StrEnum


class Volume(StrEnum):
    """The two sides mirrord looks at."""

    PRIMARY = "primary"
    MIRROR = "mirror"


class Veto(StrEnum):
    """Why a guard keeps a file retention planned to delete (`mirrord_prune_skipped_total{reason}`)."""

    RECENT_MTIME = "recent_mtime"
    ZERO_MTIME = "zero_mtime"
    FUTURE_MTIME = "future_mtime"
    IN_FLIGHT = "in_flight"
    NEWEST = "newest"
    NOT_REGULAR = "not_regular"
    RECENTLY_SEEN = "recently_seen"  # not seen unchanged by this process for min_age_seconds (monotonic)
    UNCONFIRMED = "unconfirmed"  # a mirror copy whose stat no longer matches its record: verified again first


class Held(StrEnum):
    """Why retention keeps a mirror copy its policy alone would let go (`mirrord_retention_held_files{reason}`)."""

    PAUSED = "paused"  # its run's newest verified checkpoint is gone from the primary (wiped, unmounted)
    UNCONFIRMED = "unconfirmed"  # its stat no longer matches its record (e.g. mtime set to 0): verified again first
    BRANCH_TIP = "branch_tip"  # the newest checkpoint of an abandoned branch (a rollback, a restart from scratch)
    POINTER = "pointer"  # named by a pointer (Lightning's last.ckpt, DeepSpeed's latest, HF's best checkpoint)
    NOT_ROTATED = "not_rotated"  # follow: gone from the primary without evidence the trainer rotated it (a wipe, an rm)


class CopyOutcome(StrEnum):
    """The result of one copy attempt (`mirrord_copies_total{result}`); errors carry theirs as `reason`."""

    OK = "ok"
    FAILED = "failed"  # any error without a result of its own
    SOURCE_CHANGED = "source_changed"
    SIZE_MISMATCH = "size_mismatch"
    NO_SPACE = "no_space"
    STALLED = "stalled"
    INVALID_SOURCE = "invalid_source"
    SOURCE_GONE = "source_gone"  # the trainer deleted it before it was copied: rotation, not failure
    ALIASED = "aliased"  # an alias (last.ckpt) published from the mirrored step with its bytes: none written
    NODE_CONFLICT = "node_conflict"  # another node recorded this name with other bytes (mirrord.core.nodes)


class PruneRefusal(StrEnum):
    """Why retention refused a whole cycle (the first three) or one deletion (the rest)."""

    PARTIAL_VIEW = "partial_view"
    MIRROR_UNMOUNTED = "mirror_unmounted"
    MANIFEST = "manifest"
    CHANGED = "changed"
    RESTAT_FAILED = "restat_failed"
    FAILED = "failed"  # any other error
