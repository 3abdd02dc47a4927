"""watchdog glue: filesystem events on the primary become hints for the daemon's main loop.

Events are hints, never the truth: the reconciler rescans both sides periodically and after an
inotify queue overflow, so a lost event delays a copy by at most one rescan interval.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from watchdog.events import (
    DirMovedEvent,
    EventsLostEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver
from watchdog.observers.inotify import InotifyEmitter
from watchdog.observers.inotify_c import CallbackId, InotifyFD, Mask, WatchCallback, WatchDescriptor
from watchdog.observers.polling import PollingObserver

from mirrord.config import Config
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.store.scan import is_candidate_name

# Filesystems on which inotify sees only local changes (or none): events from other clients of the
# share never arrive, so only polling works there.
REMOTE_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "v9fs",
        "drvfs",
        "fuse",
        "fuseblk",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "afs",
        "sshfs",
        "beegfs",
        "davfs",
        "s3fs",
    }
)
# watchdog walks the tree by path and recursively, a frame per level (os.walk before Python 3.12, its
# snapshot's walk): a folder 1,200 levels deep exceeded the interpreter's limit and killed the watch. A
# path names at most PATH_MAX / 2 levels ("a/" each), so a limit above that covers any tree it can walk. It is
# raised for the whole process: CPython's limit is the interpreter's, not a thread's, and watchdog's walks
# take no function of ours. A frame per level of such a path stays far inside a thread's stack.
_WALK_RECURSION_LIMIT = 4096 // 2 + 1000


@dataclass(frozen=True)
class Hint:
    """A filesystem event on the primary, as the daemon's loop sees it (a hint, never the truth)."""

    rel: str
    committed: bool  # True for a rename into the final name: the writer says the file is whole
    rescan: bool = False  # a rescan unless `rel` lies in a folder unit (then that unit is judged again)


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


# The events _Handler acts on. Given to watchdog as its event filter, they are also the inotify mask: without
# it every open and close-without-write below the primary is an event too, and each rescan opens and closes
# every folder of the primary (a trainer reading its data or checkpoints there adds its own), each event
# parsed by the watch thread in Python while the rescan waits for the interpreter lock.
HANDLED_EVENTS = (DirMovedEvent, FileMovedEvent, FileClosedEvent, FileCreatedEvent, FileModifiedEvent, EventsLostEvent)


class _Handler(FileSystemEventHandler):
    """Turns watchdog events into hints: a rename onto a final name commits it; a moved folder asks for a rescan."""

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
        if isinstance(event, EventsLostEvent):
            # The kernel's queue overflowed. watchdog queues this once it has re-armed the watches of
            # folders made meanwhile, so a rescan from here on misses nothing (one asked for at the
            # overflow itself could list the tree before those watches exist, and miss files in them).
            self.emit(Hint("", committed=False, rescan=True))
        elif isinstance(event, DirMovedEvent):
            # A folder moved in: a unit folder (renamed into place when written) is judged again alone;
            # anything else (a whole run folder) asks for a rescan.
            self.emit(Hint(self._rel(event.dest_path) or "", committed=False, rescan=True))
        elif isinstance(event, FileMovedEvent):
            rel = self._rel(event.dest_path)
            if rel is not None:
                self.emit(Hint(rel, committed=True))
        elif isinstance(event, FileClosedEvent | FileCreatedEvent | FileModifiedEvent):
            rel = self._rel(event.src_path)
            if rel is not None:
                self.emit(Hint(rel, committed=False))


class _Inotify(InotifyFD):
    """watchdog's inotify instance, keeping the first folder it could not watch: when the watch limit runs out
    (ENOSPC, EMFILE) at a folder made under the primary, watchdog goes on without it and the files written
    there send no events at all, so the watch is not to be trusted from then on."""

    cause: str | None = None

    def add_callback(self, path: bytes, mask: Mask, callback: WatchCallback, id_: CallbackId) -> WatchDescriptor:
        try:
            return super().add_callback(path, mask, callback, id_)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EMFILE) and self.cause is None:
                self.cause = f"cannot watch {os.fsdecode(path)}: {exc.strerror or exc}"
            raise


class Watcher:
    """Starts the chosen observer on the primary and forwards hints to `emit` (called from its thread)."""

    def __init__(
        self, root: Path, patterns: Iterable[str], mode: str, poll_interval: float, emit: Callable[[Hint], None]
    ) -> None:
        self.mode = mode
        # Native: watchdog's inotify observer, on an inotify instance of ours that tells what it cannot watch.
        self.inotify = None if mode == "polling" else _Inotify()
        self.observer: BaseObserver = (
            PollingObserver(timeout=poll_interval)
            if self.inotify is None
            else BaseObserver(InotifyEmitter, inotify_fd=self.inotify)
        )
        if self.inotify is not None:
            self.inotify.start()  # its reader thread, stopped in stop()
        self.observer.name = f"mirrord-watch-{mode}"
        self.observer.schedule(
            _Handler(root, tuple(patterns), emit), os.fsdecode(root), recursive=True, event_filter=list(HANDLED_EVENTS)
        )

    def unwatched(self) -> str | None:
        """Why part of the primary is not watched (a folder inotify could not watch), or None."""
        return self.inotify.cause if self.inotify else None

    def start(self) -> None:
        """Start the observer thread."""
        sys.setrecursionlimit(max(sys.getrecursionlimit(), _WALK_RECURSION_LIMIT))
        self.observer.start()

    def is_alive(self) -> bool:
        """Whether the observer thread still runs."""
        return self.observer.is_alive()

    def stop(self) -> None:
        """Stop the observer (and its inotify instance) and wait (bounded) for their threads."""
        try:
            self.observer.stop()
            self.observer.join(timeout=10)
        finally:
            if self.inotify is not None:
                self.inotify.stop()
                self.inotify.join(timeout=10)


def watched(cfg: Config) -> tuple[str, ...]:
    """Names whose events are hints: the layout's checkpoint files, or with folder units any file (a
    folder is judged whole from a listing, which a hint about any of its files asks for)."""
    rules = cfg.rules
    return ("*",) if rules.folders else rules.patterns + rules.aliases


class WatcherLike(Protocol):
    """What the daemon needs of a watcher (the real one, or a test's fake)."""

    def start(self) -> None:
        """Start delivering hints."""

    def is_alive(self) -> bool:
        """Whether hints are still delivered."""

    def unwatched(self) -> str | None:
        """Why part of the tree sends no hints (None: all of it does)."""

    def stop(self) -> None:
        """Stop delivering hints; bounded."""


# Builds an unstarted watcher: (root, patterns, mode, poll interval, emit) -> watcher.
WatcherFactory = Callable[[Path, tuple[str, ...], str, float, Callable[[Hint], None]], WatcherLike]


class PrimaryWatch:
    """The daemon's watch on the primary: the chosen mode, a fallback to polling when native watching
    cannot start or later cannot watch a new folder (the inotify watch limit), and a re-arm when the root
    is another directory now (recreated, or a filesystem mounted on it) or the watcher died."""

    def __init__(
        self,
        config: Callable[[], Config],
        root_key: Callable[[], tuple[int, int]],
        emit: Callable[[Hint], None],
        metrics: Metrics,
        factory: WatcherFactory = Watcher,
    ) -> None:
        self._config, self.root_key, self.emit = config, root_key, emit
        self.metrics, self.factory = metrics, factory
        self.watcher: WatcherLike | None = None
        self._key: tuple[int, int] | None = None
        self.closed = False  # stopped for good (the daemon is stopping): nothing to check or re-arm
        # Why native watching was given up for this daemon's life (it ran out of inotify watches once:
        # it would again), or None.
        self.polling_since: str | None = None
        self.log = get_logger()

    def start(self) -> None:
        """Start watching (native or polling as configured and as the filesystem allows); OSError if
        even polling cannot start."""
        cfg = self._config()
        self._key = None
        with contextlib.suppress(OSError):
            self._key = self.root_key()
        fstype = filesystem_type(cfg.primary)
        mode, why = ("polling", self.polling_since) if self.polling_since else choose_mode(cfg.watch.mode, fstype)
        try:
            self.watcher = self._started(mode)
        except OSError as exc:
            if mode == "polling":
                raise
            # e.g. "inotify watch limit reached" on a big tree: polling is slower but still correct.
            self.log.error(
                "watch.native_failed",
                cause=exc.strerror or str(exc),
                fallback="polling",
                hint="raise fs.inotify.max_user_watches, or set watch.mode = polling",
            )
            mode, why = "polling", f"native watch failed: {exc.strerror or exc}"
            self.watcher = self._started(mode)
        for each in ("native", "polling"):
            self.metrics.watch_mode.labels(each).set(each == mode)
        self.log.info("watch.mode", mode=mode, fstype=fstype, why=why)

    def _started(self, mode: str) -> WatcherLike:
        cfg = self._config()
        watcher = self.factory(cfg.primary, watched(cfg), mode, cfg.watch.poll_interval_seconds, self.emit)
        try:
            watcher.start()
        except OSError:
            with contextlib.suppress(Exception):
                watcher.stop()
            raise
        return watcher

    def check(self) -> list[str]:
        """Re-arm when the root changed or the watcher died (then ask for a rescan: what changed
        meanwhile); returns the problems for this heartbeat's health."""
        if self.closed:
            return []
        primary = self._config().primary
        try:
            key: tuple[int, int] | None = self.root_key()
        except OSError as exc:
            return [f"primary root {primary}: {exc.strerror or exc}"]
        problems = []
        alive = self.watcher is not None and self.watcher.is_alive()
        unwatched = self.watcher.unwatched() if alive and self.watcher is not None else None
        if not alive:
            problems.append("filesystem watcher stopped")
        if alive and key == self._key and not unwatched:
            return problems
        why = "watcher died" if not alive else "primary root changed (recreated or mounted over)"
        if unwatched:  # the events of that folder's files never arrive: poll the whole tree from now on
            self.polling_since = why = f"native watch incomplete: {unwatched}"
            self.log.error(
                "watch.native_failed",
                cause=unwatched,
                fallback="polling",
                hint="raise fs.inotify.max_user_watches, or set watch.mode = polling",
            )
        self.log.warning("watch.rearm", why=why, primary=str(primary))
        self.stop()
        try:
            self.start()
        except OSError as exc:
            problems.append(f"cannot watch {primary}: {exc.strerror or exc}")
        self.emit(Hint("", committed=False, rescan=True))
        return problems

    def close(self) -> None:
        """Stop watching for good: a heartbeat while the daemon stops must not take the stopped watcher
        for a dead one and start it again."""
        self.closed = True
        self.stop()

    def stop(self) -> None:
        """Stop the watcher, if any (never raises)."""
        if self.watcher is not None:
            with contextlib.suppress(Exception):
                self.watcher.stop()
