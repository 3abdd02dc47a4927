"""One small exception tree: every error names the path and the cause, and says whether a retry may help."""

from __future__ import annotations

import errno
from collections.abc import Hashable

from mirrord.vocabulary import CopyOutcome, PruneRefusal


class MirrordError(Exception):
    """Base of every error mirrord raises on purpose.

    `reason` is a stable snake_case word used in logs and as a metric label.
    """

    reason: str = CopyOutcome.FAILED
    transient = False

    def __init__(self, path: object, cause: str) -> None:
        self.path = str(path)
        self.cause = cause
        super().__init__(f"{self.path}: {cause}")


class TransientError(MirrordError):
    """Worth retrying: the same operation may succeed later."""

    transient = True


class UnreachableError(TransientError, OSError):
    """The storage did not answer (connection refused or timed out, a 5xx): worth another try. Also an
    OSError, as an I/O error of a volume is: every path that survives one survives a storage blip."""


class PermanentError(MirrordError):
    """Retrying will not help until something outside mirrord changes."""


class SourceChangedError(TransientError):
    """The source changed while it was being copied; the copy was discarded."""

    reason = CopyOutcome.SOURCE_CHANGED


class SourceGoneError(PermanentError):
    """The source was deleted before or while it was copied: the trainer rotated it away. Nothing is
    left to mirror, so it is not a failure (counted as source_gone, logged at info, never retried)."""

    reason = CopyOutcome.SOURCE_GONE


class SizeMismatchError(TransientError):
    """The bytes that reached the mirror are not the size the source had."""

    reason = CopyOutcome.SIZE_MISMATCH


class NoSpaceError(TransientError):
    """The mirror has not enough free space for the file plus the reserve."""

    reason = CopyOutcome.NO_SPACE


class StalledError(TransientError):
    """A copy made no progress for too long (a hung mount); it was abandoned."""

    reason = CopyOutcome.STALLED


class CancelledError(MirrordError):
    """A copy was aborted because the daemon is shutting down."""

    reason = "cancelled"


class InvalidSourceError(PermanentError):
    """The source is not a whole checkpoint (empty, truncated, a bad CRC): it was not published.

    Not retried with backoff: a torn file is usually still being written, so the daemon waits for it
    to change and settle again. `status` is the validator's (truncated, crc_mismatch, empty, ...).
    """

    reason = CopyOutcome.INVALID_SOURCE

    def __init__(self, path: object, cause: str, status: str = "invalid", identity: Hashable | None = None) -> None:
        super().__init__(path, cause)
        self.status = status
        # What was judged: a file's (inode, size, mtime_ns, ctime_ns); a folder unit's, every file's
        # (mirrord.core.units.unit_identity). None: unknown, judge it again next time.
        self.identity = identity


class ManifestError(PermanentError):
    """The manifest cannot be read or parsed: nothing may be trusted or pruned from it."""

    reason = PruneRefusal.MANIFEST


class ChangedError(PermanentError):
    """The file is no longer the one that was planned for deletion."""

    reason = PruneRefusal.CHANGED


class UnsafePathError(PermanentError, ValueError):
    """A relative path that could leave its root ('..', absolute, empty parts, NUL): never opened.

    Also a ValueError, as a malformed name is one (a manifest entry naming one is not an entry).
    """

    reason = "unsafe_path"


class StartupError(Exception):
    """mirrord cannot start as configured (a busy port, a locked or unreadable mirror)."""


class ConfigError(Exception):
    """Configuration problems, one message per problem naming the key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class LockedError(PermanentError):
    """Another mirrord process holds the mirror."""

    reason = "locked"


def from_oserror(path: object, exc: OSError, action: str) -> MirrordError:
    """Wrap an OSError into the typed tree, keeping errno's meaning for retries."""
    cause = f"{action}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpaceError(path, cause)
    # A condition that can go away by itself (a flaky mount, a stale NFS handle); else permanent until a person acts.
    if exc.errno in (
        errno.EIO,
        errno.ESTALE,
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.EINTR,
        errno.EBUSY,
        errno.ENOTCONN,
        errno.ECONNRESET,
        errno.EHOSTDOWN,
    ):
        return TransientError(path, cause)
    return PermanentError(path, cause)


class DamagedCopyError(PermanentError):
    """A mirror copy is not what its manifest entry recorded (missing, other size, other hash): restore
    publishes nothing from it."""

    reason = "damaged_copy"


class NodeConflictError(PermanentError):
    """Another node of a shared prefix recorded this name with other bytes: never uploaded over its copy."""

    reason = CopyOutcome.NODE_CONFLICT


class DestinationTakenError(PermanentError):
    """A restore's destination holds something else than the checkpoint: never overwritten without --force."""

    reason = "destination_taken"


class NothingToRestoreError(PermanentError):
    """The mirror holds no verified checkpoint that matches the request."""

    reason = "nothing_to_restore"


class WhichRunError(PermanentError, ValueError):
    """Restore was given a run the mirror does not hold, or none while it holds several: the runs are listed."""

    reason = "which_run"
