"""watchdog glue: filesystem events on the primary become hints for the daemon's main loop.

Events are hints, never the truth: the reconciler rescans both sides periodically and after an
inotify queue overflow, so a lost event delays a copy by at most one rescan interval.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import (
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from mirrord.scan import is_candidate_name

# Filesystems on which inotify sees only local changes (or none): events from other clients of the
# share never arrive, so only polling works there.
REMOTE_FS_TYPES = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "v9fs", "drvfs", "fuse", "fuseblk", "ceph",
     "glusterfs", "lustre", "gpfs", "afs", "sshfs", "beegfs", "davfs", "s3fs"}
)
_OVERFLOW_LOGGER = "watchdog.observers.inotify_c"


@dataclass(frozen=True)
class Hint:
    rel: str
    committed: bool  # True for a rename into the final name: the writer says the file is whole
    rescan: bool = False


def filesystem_type(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The fstype of the mount holding `path` (longest matching mount point), or 'unknown'."""
    target = str(Path(path).resolve())
    best, best_type = "", "unknown"
    try:
        with open(mountinfo, encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].encode().decode("unicode_escape")
                fstype = right.split()[0]
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fstype
    except (OSError, IndexError):
        return "unknown"
    return best_type


def choose_mode(configured: str, fstype: str) -> tuple[str, str]:
    """(mode, why) for the watch.mode setting and the primary's filesystem type."""
    if configured != "auto":
        return configured, f"watch.mode = {configured}"
    base = fstype.split(".", 1)[0]
    if base in REMOTE_FS_TYPES:
        return "polling", f"primary is on {fstype}, where inotify does not see other clients' writes"
    return "native", f"primary is on {fstype}; inotify events are reliable there"


class _Handler(FileSystemEventHandler):
    def __init__(self, root: Path, patterns: tuple[str, ...], emit: Callable[[Hint], None]) -> None:
        self.root = os.fsdecode(root)
        self.patterns = patterns
        self.emit = emit

    def _rel(self, path: str | bytes) -> str | None:
        path = os.fsdecode(path)
        rel = os.path.relpath(path, self.root)
        if rel.startswith("..") or not is_candidate_name(rel.rsplit(os.sep, 1)[-1], self.patterns):
            return None
        return rel.replace(os.sep, "/")

    def on_any_event(self, event: FileSystemEvent) -> None:
        if isinstance(event, DirMovedEvent):
            self.emit(Hint("", committed=False, rescan=True))  # a whole run folder moved in
        elif isinstance(event, FileMovedEvent):
            rel = self._rel(event.dest_path)
            if rel is not None:
                self.emit(Hint(rel, committed=True))
        elif isinstance(event, FileClosedEvent | FileCreatedEvent | FileModifiedEvent):
            rel = self._rel(event.src_path)
            if rel is not None:
                self.emit(Hint(rel, committed=False))


class _OverflowDetector(logging.Handler):
    """watchdog reports an inotify queue overflow only as a log record; turn it into a rescan."""

    def __init__(self, emit: Callable[[Hint], None]) -> None:
        super().__init__(logging.WARNING)
        self.emit_hint = emit

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.emit_hint(Hint("", committed=False, rescan=True))


class Watcher:
    """Starts the chosen observer on the primary and forwards hints to `emit` (called from its thread)."""

    def __init__(
        self, root: Path, patterns: Iterable[str], mode: str, poll_interval: float, emit: Callable[[Hint], None]
    ) -> None:
        self.mode = mode
        self.observer: BaseObserver = (
            PollingObserver(timeout=poll_interval) if mode == "polling" else Observer()
        )
        self.observer.name = f"mirrord-watch-{mode}"
        self.observer.schedule(_Handler(root, tuple(patterns), emit), os.fsdecode(root), recursive=True)
        self._overflow = _OverflowDetector(emit)

    def start(self) -> None:
        logging.getLogger(_OVERFLOW_LOGGER).addHandler(self._overflow)
        self.observer.start()

    def is_alive(self) -> bool:
        return self.observer.is_alive()

    def stop(self) -> None:
        logging.getLogger(_OVERFLOW_LOGGER).removeHandler(self._overflow)
        self.observer.stop()
        self.observer.join(timeout=10)
