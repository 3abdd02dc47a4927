"""The manifest's durable form on a local filesystem: a snapshot plus append-only journals.

    .mirrord-manifest.json         the snapshot, published with mirrord.store.atomic; names its generation S
    .mirrord-manifest.journal.S    changes made after snapshot S: one checksummed line per record
    .mirrord-manifest.journal.S+1  (only while a compaction is under way, or after one failed)

Recording a change costs one append and one fsync of the journal, whatever the manifest's size.
Compaction folds the journals into a new snapshot, in three steps, each safe to crash after:

    1. create journal S+1 (atomically, holding only its header); appends go there from now on
    2. publish snapshot S+1 = everything recorded before step 1 (atomically)
    3. unlink the journals older than S+1, fsync the directory (a failure is raised: it leaves only
       stale journals, which readers ignore, but an I/O error is never silent)

Before step 2 a reader replays journals S and S+1 on snapshot S; after it, journal S is stale and
ignored. Readers replay the journals >= S, which must be S, S+1, ... without a gap: anything else (a
snapshot deleted by hand, a journal lost) is an error naming the files, never a silent partial view.

A record is a line `CRC32 JSON\\n`. A last line that is incomplete or fails its checksum is a record
whose append never finished (nobody was told it was recorded): it is ignored, and cut off before the
next append. A bad line followed by a good one is corruption: an error naming the journal.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Generic, TypeVar

from mirrord.errors import ManifestError, NoSpaceError
from mirrord.store import atomic

if TYPE_CHECKING:
    import hashlib

JOURNAL_SCHEMA = "mirrord-manifest-journal"
JOURNAL_VERSION = 1
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_ATTEMPTS = 50  # a compaction finishing while we read makes us read again; 50 in a row is a fault

T = TypeVar("T")


def frame(payload: bytes) -> bytes:
    """One journal line: the payload's CRC-32 in hex, a space, the payload (no newline in it)."""
    if b"\n" in payload:
        raise ValueError("a journal record cannot contain a newline")
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def _unframe(line: bytes) -> bytes | None:
    if len(line) < 10 or line[8:9] != b" ":
        return None
    payload = line[9:]
    try:
        crc = int(line[:8], 16)
    except ValueError:
        return None
    return payload if zlib.crc32(payload) == crc else None


def parse_journal(data: bytes, where: str) -> tuple[list[bytes], int]:
    """(the payloads of every whole record, the byte length they span). The header is checked, not returned.

    A torn tail (an incomplete or bad last line, or several bad lines at the end) is left out; a bad
    line with a good one after it raises ManifestError naming `where`.
    """
    payloads: list[bytes] = []
    valid = pos = 0
    bad_at: int | None = None
    for line in data.split(b"\n")[:-1]:  # the piece after the last newline is incomplete by definition
        payload = _unframe(line)
        if payload is None:
            bad_at = pos if bad_at is None else bad_at
        elif bad_at is not None:
            raise ManifestError(where, f"corrupt journal record at byte {bad_at} (records follow it)")
        else:
            payloads.append(payload)
            valid = pos + len(line) + 1
        pos += len(line) + 1
    if not payloads:
        raise ManifestError(where, "journal has no valid header")
    return payloads[1:], valid


def _header(generation: int) -> dict[str, object]:
    return {"schema": JOURNAL_SCHEMA, "version": JOURNAL_VERSION, "generation": generation}


def _check_header(data: bytes, generation: int, where: str) -> None:
    try:
        doc = json.loads(_unframe(data.split(b"\n", 1)[0]) or b"null")
    except ValueError:
        doc = None
    found = doc if isinstance(doc, dict) else {}
    for key, why in (
        ("schema", "not a mirrord manifest journal (bad header)"),
        ("version", f"unsupported journal version {found.get('version')!r}"),
        ("generation", f"journal header says generation {found.get('generation')!r}, its name {generation}"),
    ):
        if found.get(key) != _header(generation)[key]:
            raise ManifestError(where, why)


@dataclass(frozen=True, slots=True)
class JournalFile:
    """One journal file as read: its generation and whole records (a torn last one is not counted)."""

    generation: int
    path: Path
    records: list[bytes]
    torn_at: int | None  # where the last whole record ends, if bytes follow it (a torn append)


@dataclass
class Stored(Generic[T]):
    """One consistent reading: the parsed snapshot (None if there is none) and the journals to replay."""

    snapshot: T | None
    generation: int
    journals: list[JournalFile]


def _sha256(data: bytes) -> hashlib._Hash:
    """hashlib.sha256, imported on first use (a read-only load, `mirrord latest`, hashes nothing)."""
    import hashlib

    return hashlib.sha256(data)


def _identity(st: os.stat_result | None) -> tuple[int, ...] | None:
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _lstat_identity(path: Path) -> tuple[int, ...] | None:
    try:
        return _identity(path.lstat())
    except OSError:
        return None


def _open_nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


class LocalManifestStore:
    """Snapshot and journals in one directory (the mirror root). Appends are serialised by the caller."""

    def __init__(
        self, root: Path, snapshot_name: str, read_only: bool = False, guard: Callable[[], None] | None = None
    ) -> None:
        self.root = Path(root)
        # Only read, never written through (Manifest.load): it keeps no record of what it read for
        # damage(), so the snapshot is not hashed.
        self.read_only = read_only
        self.snapshot_path = self.root / snapshot_name
        self.prefix = snapshot_name.removesuffix(".json") + ".journal."
        self._name = re.compile(re.escape(self.prefix) + r"(0|[1-9][0-9]{0,17})")
        self._generation = 0  # of the journal appends go to
        self._torn_at: int | None = None  # where that journal's whole records end, if bytes follow them
        self._exists = False
        self._must_rotate = False
        self._initial: bytes | None = None  # an empty snapshot to publish before the first journal
        self.journal_records = 0  # since the last compaction began: the caller's compaction policy
        # Called before every write (the mirror's identity check: never write to whatever lies under
        # an unmounted mount point).
        self.guard = guard or (lambda: None)
        # What this process last read or wrote: snapshot (identity, sha256), journal identity. A
        # difference means someone else changed the files (see damage()).
        self._snapshot_seen: tuple[tuple[int, ...] | None, str] | None = None
        self._journal_seen: tuple[int, ...] | None = None

    def shared_entries(self) -> None:
        """None: a local manifest has one writer, this process (the mirror's flock holder)."""
        return None

    def journal_path(self, generation: int) -> Path:
        """The path of journal number `generation`."""
        return self.root / f"{self.prefix}{generation}"

    # -- reading (any process, read-only) ---------------------------------------------------------
    def read(self, parse: Callable[[bytes, str], tuple[T, int]]) -> Stored[T]:
        """Snapshot (as `parse` makes it of its bytes) and journals as of one instant, even while a writer
        appends and compacts.

        The snapshot is read first, then the journals are opened; if the snapshot was replaced in the
        meantime (a compaction published and may have unlinked what we were about to open), read again.
        An open journal stays readable after a compaction unlinks it, and it only grows by appends.
        """
        for _ in range(_READ_ATTEMPTS):
            if (stored := self._read_once(parse)) is not None:
                return stored
        raise ManifestError(self.snapshot_path, "kept changing while being read (a compaction loop?)")

    def _read_once(self, parse: Callable[[bytes, str], tuple[T, int]]) -> Stored[T] | None:
        where = str(self.snapshot_path)
        try:
            with open(self.snapshot_path, "rb", opener=_open_nofollow) as f:
                before: os.stat_result | None = os.fstat(f.fileno())
                data: bytes | None = f.read()
        except FileNotFoundError:
            before = data = None
        except OSError as exc:
            raise ManifestError(where, f"cannot read manifest: {exc.strerror or exc}") from exc
        snapshot, generation = (None, 0) if data is None else parse(data, where)
        if data is not None and not self.read_only:
            self._snapshot_seen = (_identity(before), _sha256(data).hexdigest())
        with contextlib.ExitStack() as opened:
            journals: dict[int, BinaryIO] = {}
            for gen, path in self._journal_names():
                try:
                    if gen >= generation:
                        journals[gen] = opened.enter_context(open(path, "rb", opener=_open_nofollow))
                except FileNotFoundError:
                    return None  # unlinked by a compaction since we listed: read again
                except OSError as exc:
                    raise ManifestError(path, f"cannot read journal: {exc.strerror or exc}") from exc
            if _lstat_identity(self.snapshot_path) != _identity(before):
                return None
            stored = Stored(snapshot, generation, [self._read_journal(g, f) for g, f in journals.items()])
        self._check_sequence(stored, snapshot is not None)
        return stored

    def _journal_names(self) -> list[tuple[int, Path]]:
        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ManifestError(self.root, f"cannot list the manifest's directory: {exc.strerror or exc}") from exc
        return sorted((int(m[1]), self.root / n) for n in names if (m := self._name.fullmatch(n)))

    def _read_journal(self, generation: int, f: BinaryIO) -> JournalFile:
        path = self.journal_path(generation)
        try:
            data = f.read()
        except OSError as exc:
            raise ManifestError(path, f"cannot read journal: {exc.strerror or exc}") from exc
        _check_header(data, generation, str(path))
        records, valid = parse_journal(data, str(path))
        return JournalFile(generation, path, records, valid if valid < len(data) else None)

    def _check_sequence(self, stored: Stored[T], have_snapshot: bool) -> None:
        gens = [j.generation for j in stored.journals]
        if not gens:
            return
        if not have_snapshot:
            raise ManifestError(
                self.snapshot_path,
                f"missing, but its journal {stored.journals[0].path.name} "
                "exists: run `mirrord repair-manifest` or restore the file",
            )
        if gens != list(range(stored.generation, stored.generation + len(gens))):
            raise ManifestError(
                self.snapshot_path,
                f"generation {stored.generation} does not match its "
                f"journals ({', '.join(j.path.name for j in stored.journals)}): a journal "
                "is missing or the snapshot is out of date",
            )

    # -- writing (the process holding the mirror lock) ------------------------------------------------
    def open_for_append(self, stored: Stored[T], empty_snapshot: bytes) -> None:
        """Continue after `stored`: appends go to its newest journal (created on first use). Without a
        snapshot, `empty_snapshot` is published before the first journal, which never exists alone."""
        self._initial = empty_snapshot if stored.snapshot is None else None
        newest = stored.journals[-1] if stored.journals else None
        self._generation = newest.generation if newest else stored.generation
        self._torn_at = newest.torn_at if newest else None
        self._exists = newest is not None
        self.journal_records = sum(len(j.records) for j in stored.journals)
        self._journal_seen = _lstat_identity(self.journal_path(self._generation)) if self._exists else None

    def append(self, payloads: Iterable[bytes]) -> None:
        """Append the records in one write and make them durable with one fsync; raise on any failure.

        After a failure the journal may hold part of the write, and a file whose fsync failed is never
        fsynced again (its pages' state is unknown): appends move to a new journal, and the caller
        compacts at once (Manifest.apply), so that the failed records are not replayed at the next load.
        The journal is opened for each append, so no descriptor keeps the mirror busy (an unmount).
        """
        data = b"".join(frame(p) for p in payloads)
        path = self.journal_path(self._generation)
        self.guard()
        try:
            if self._must_rotate and self._exists:
                self.rotate()
            self._must_rotate = False
            path = self.journal_path(self._generation)
            if not self._exists:
                self._create(self._generation)
            fd = os.open(path, _APPEND_FLAGS)
            try:
                if self._torn_at is not None:  # never acknowledged: cut off, lest the next record read as corruption
                    os.ftruncate(fd, self._torn_at)
                    atomic.sync(fd)
                    self._torn_at = None
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                atomic.sync(fd)
                self._journal_seen = _identity(os.fstat(fd))
            finally:
                os.close(fd)
        except BaseException as exc:
            self._must_rotate = True
            if isinstance(exc, OSError):
                raise _error(path, exc, "append to the manifest journal") from exc
            raise
        self.journal_records += 1

    def _create(self, generation: int) -> None:
        if self._initial is not None:
            self.publish_snapshot(self._initial)
            self._initial = None
        with atomic.atomic_output(self.journal_path(generation), mode=self._mode()) as f:
            f.write(frame(json.dumps(_header(generation), separators=(",", ":")).encode()))
        self._exists = True
        self._journal_seen = _lstat_identity(self.journal_path(generation))

    def _mode(self) -> int:
        """0600, or 0640 when the mirror root is group-readable: the manifest names every checkpoint with its
        size and hash, so no other user reads it; a read-only group (docs/security.md) does."""
        return 0o600 | (self.root.stat().st_mode & 0o040)

    def rotate(self) -> int:
        """Step 1 of a compaction: a new, empty journal receives the appends from now on."""
        self.guard()
        generation = self._generation + 1
        path = self.journal_path(generation)
        try:
            if not self._exists:  # the sequence of journals after a snapshot never has a gap
                self._create(self._generation)
            self._create(generation)
        except OSError as exc:
            raise _error(path, exc, "create the manifest journal") from exc
        self._generation, self._torn_at, self._must_rotate = generation, None, False
        self.journal_records = 0
        return generation

    def publish_snapshot(self, data: bytes) -> None:
        """Step 2: the snapshot of everything recorded before the rotation that gave it its generation."""
        self.guard()
        try:
            atomic.write_bytes_atomic(self.snapshot_path, data, mode=self._mode())
        except OSError as exc:
            raise _error(self.snapshot_path, exc, "write manifest") from exc
        self._snapshot_seen = (_lstat_identity(self.snapshot_path), _sha256(data).hexdigest())

    def damage(self) -> str | None:
        """None while the snapshot and the current journal are what this process last read or wrote;
        else what happened (changed, truncated, removed, replaced). The caller serialises it with the
        appends. Reads the snapshot only when its stat changed: cheap enough for every heartbeat."""
        seen, path = self._snapshot_seen, self.snapshot_path
        if seen is not None:
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and _identity(st) != seen[0]:
                    if _sha256(path.read_bytes()).hexdigest() != seen[1]:
                        return f"{path} was changed on disk behind mirrord's back"
                    self._snapshot_seen = (_identity(st), seen[1])  # touched, not changed
            except FileNotFoundError:
                return f"{path} was removed behind mirrord's back"
            except OSError as exc:
                return f"{path}: cannot read: {exc.strerror or exc}"
            if not stat.S_ISREG(st.st_mode):
                return f"{path} is no longer a regular file"
        if self._exists and self._journal_seen is not None:
            path = self.journal_path(self._generation)
            if _lstat_identity(path) != self._journal_seen:
                return f"{path} was changed, truncated or removed behind mirrord's back"
        return None

    def drop_before(self, generation: int) -> None:
        """Step 3: unlink the journals a published snapshot made stale, then fsync the directory.

        Every stale journal is tried even after one fails; then the first failure is raised, naming its
        path. The snapshot is already durable, so a stale journal left behind (or brought back by a crash
        because its unlink was not made durable) is ignored by readers and dropped by the next compaction:
        harmless for the manifest, but an I/O error on the mirror is never silent.
        """
        self.guard()
        failures: list[tuple[Path, OSError, str]] = []
        stale = [path for gen, path in self._journal_names() if gen < generation]
        for path in stale:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                failures.append((path, exc, "remove the stale manifest journal"))
        if stale:
            try:
                atomic.fsync_dir(self.root)
            except OSError as exc:
                failures.append(
                    (self.root, exc, "make the removal of stale manifest journals durable (fsync of the directory)")
                )
        if failures:
            raise _error(*failures[0])


def _error(path: Path, exc: OSError, action: str) -> ManifestError | NoSpaceError:
    """ENOSPC is transient (pruning or a retry may free space); anything else makes the manifest unusable."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpaceError(path, f"cannot {action}: {exc.strerror}")
    return ManifestError(path, f"cannot {action}: {exc.strerror or exc}")
