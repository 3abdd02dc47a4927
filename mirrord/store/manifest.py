"""The resume record: what every mirrored artifact must be (size and content hash) to count as intact.

On disk (mirrord.store.journal): a JSON snapshot at the mirror root plus an append-only journal of the
changes made since, folded into a new snapshot now and then. Size alone is not integrity; the digest is.

A change counts only once its journal record is durable: memory is updated after the fsync, so
nothing (a prune, `latest`, a status) ever relies on a record a crash could take back. Changes from
several threads that arrive while a record is being written go to disk together in the next write
(group commit: one fsync for all of them).
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mirrord.core.model import ManifestEntry
from mirrord.core.nodes import Matched
from mirrord.errors import ManifestError, MirrordError
from mirrord.obs.log import get_logger
from mirrord.paths import split_rel
from mirrord.store.hashing import ALGORITHMS
from mirrord.store.journal import LocalManifestStore, Stored

if TYPE_CHECKING:
    # Contributions (several nodes writing one folder unit) live in object stores only: a local manifest's
    # reader never builds them, nor loads their module.
    from mirrord.core.contributions import Contribution, Contributions, Merged
    from mirrord.layouts import Layout

MANIFEST_NAME = ".mirrord-manifest.json"
REPAIR_HINT = "stop mirrord and run `mirrord repair-manifest` to rebuild it from the mirror's files"
SCHEMA = "mirrord-manifest"
SCHEMA_VERSION = 1
# A compaction rewrites every entry, so it waits for this many records, or a quarter of the entries if
# that is more: its cost per record stays constant and replaying the journal stays cheaper than the snapshot.
COMPACT_MIN_RECORDS = 1000


# -- encoding -------------------------------------------------------------------------------------------
# Every field of ManifestEntry except the key (path) and the nested hash is stored under its own name
# (decode_entry reads them by name; tests/unit/test_manifest.py checks that every field survives both ways).
_PLAIN = tuple(f for f in fields(ManifestEntry) if f.name not in ("path", "algo", "digest"))


def encode_entry(e: ManifestEntry) -> dict[str, Any]:
    """One entry as the manifest's JSON stores it."""
    raw: dict[str, Any] = {
        "size": e.size,
        "hash": {"algo": e.algo, "digest": e.digest},
        **{f.name: getattr(e, f.name) for f in _PLAIN},
    }
    if raw.get("mirror_mtime_ns") in (None, e.source_mtime_ns):
        raw.pop("mirror_mtime_ns", None)  # only where the mirror could not store the source's mtime
    for name in ("node", "unit", "role"):  # a local mirror's entries: no node; a file unit: no folder
        if not raw[name]:
            raw.pop(name)
    return raw


def decode_entry(path: str, raw: dict[str, Any]) -> ManifestEntry:
    """Raises ValueError/KeyError/TypeError for anything that is not a valid entry."""
    split_rel(path)  # ValueError unless a plain relative path: an entry never names a file outside the root
    unit = str(raw.get("unit", ""))
    if unit and not path.startswith(unit + "/"):
        raise ValueError(f"{path}: recorded as a member of {unit!r}, which is not a folder above it")
    hashed = raw["hash"]
    algo = str(hashed["algo"])
    if algo not in ALGORITHMS:
        raise ValueError(f"{path}: unknown hash algorithm {algo!r}")
    get = raw.get
    step, mirror_mtime_ns, validation = raw["step"], get("mirror_mtime_ns"), get("validation")
    # Fields newer than the manifest take their defaults; the older ones are required (KeyError).
    return ManifestEntry(
        path,
        int(raw["size"]),
        algo,
        str(hashed["digest"]),
        int(raw["source_mtime_ns"]),
        None if step is None else int(step),
        float(raw["mirrored_at"]),
        None if mirror_mtime_ns is None else int(mirror_mtime_ns),
        None if validation is None else str(validation),
        int(get("mirror_ino", 0)),
        int(get("mirror_ctime_ns", 0)),
        str(get("node", "")),
        str(get("layout", "")),
        unit,
        int(get("members", 1)),
        str(get("role", "")),
        *(int(get(name, 0)) for name in ("source_dev", "source_ino", "source_ctime_ns", "seq", "seen")),
    )


def _dumps(doc: Any) -> bytes:
    # Compact: the snapshot is rewritten whole by each compaction.
    try:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a file name that is not UTF-8: keep it as JSON \u escapes
        return json.dumps(doc, separators=(",", ":")).encode()


def encode_snapshot(
    entries: Mapping[str, ManifestEntry], generation: int = 0, contributions: Contributions | None = None
) -> bytes:
    """The whole manifest as one snapshot document (sorted, so equal manifests are equal bytes). An
    object store shared by several nodes also keeps their `contributions` to units not complete yet."""
    doc: dict[str, Any] = {"schema": SCHEMA, "version": SCHEMA_VERSION}
    if generation:
        doc["journal"] = generation
    doc["entries"] = {p: encode_entry(entries[p]) for p in sorted(entries)}
    if contributions:
        doc["contributions"] = {
            unit: {node: _encode_part(part) for node, part in sorted(parts.items())}
            for unit, parts in sorted(contributions.items())
            if parts
        }
    return _dumps(doc) + b"\n"


def _encode_part(part: Contribution) -> dict[str, Any]:
    return {
        "at": part.at,
        "needs": None if part.needs is None else dict(sorted(part.needs.items())),
        "files": {p: encode_entry(part.files[p]) for p in sorted(part.files)},
    }


def _decode_contributions(raw: Any) -> dict[str, dict[str, Contribution]]:
    """The `contributions` member (absent: none). ValueError/KeyError/TypeError for anything else."""
    found: dict[str, dict[str, Contribution]] = {}
    if not raw:
        return found
    from mirrord.core.contributions import Contribution

    for unit, parts in raw.items():
        split_rel(unit)
        for node, part in parts.items():
            files = {p: decode_entry(p, e) for p, e in part["files"].items()}
            if any(not p.startswith(unit + "/") for p in files):
                raise ValueError(f"a contribution to {unit} names a file outside it")
            needs = part["needs"]
            found.setdefault(unit, {})[str(node)] = Contribution(
                str(node),
                files,
                None if needs is None else {str(m): int(n) for m, n in needs.items()},
                float(part["at"]),
            )
    return found


def decode_snapshot(data: bytes, where: str) -> tuple[dict[str, ManifestEntry], int]:
    """(entries, generation) of snapshot bytes; a manifest written before the journal existed is generation 0."""
    return decode_shared_snapshot(data, where)[:2]


def decode_shared_snapshot(
    data: bytes, where: str
) -> tuple[dict[str, ManifestEntry], int, dict[str, dict[str, Contribution]]]:
    """decode_snapshot, and the nodes' contributions to units not complete yet (an object store's)."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError("not a mirrord manifest")
        if doc.get("version") != SCHEMA_VERSION:
            raise ValueError(f"unsupported manifest version {doc.get('version')!r}")
        generation = doc.get("journal", 0)
        if type(generation) is not int or generation < 0:
            raise ValueError(f"bad journal generation {generation!r}")
        raw = doc["entries"]
        if not isinstance(raw, dict):
            raise ValueError("entries is not an object")
        entries = {path: decode_entry(path, e) for path, e in raw.items()}
        return entries, generation, _decode_contributions(doc.get("contributions"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ManifestError(where, f"cannot parse manifest: {exc}; {REPAIR_HINT}") from exc


@dataclass(frozen=True, slots=True)
class Change:
    """One journal record: entries written, then paths removed; recorded all together or not at all."""

    puts: tuple[ManifestEntry, ...] = ()
    removes: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """The change as one journal record."""
        doc: dict[str, Any] = {}
        if self.puts:
            doc["put"] = {e.path: encode_entry(e) for e in self.puts}
        if self.removes:
            doc["del"] = list(self.removes)
        return _dumps(doc)

    def apply_to(self, entries: dict[str, ManifestEntry]) -> None:
        """Apply the change to an entries mapping."""
        for e in self.puts:
            entries[e.path] = e
        for rel in self.removes:
            entries.pop(rel, None)


def decode_change(payload: bytes, where: str) -> Change:
    """A journal record back as a Change (ManifestError naming `where` if it is not one)."""
    try:
        doc = json.loads(payload)
        puts = tuple(decode_entry(p, raw) for p, raw in doc.get("put", {}).items())
        removes = tuple(doc.get("del", ()))
        for rel in removes:
            split_rel(rel)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ManifestError(where, f"cannot parse journal record: {exc}") from exc
    return Change(puts, removes)


def _replay(stored: Stored[dict[str, ManifestEntry]]) -> dict[str, ManifestEntry]:
    entries = stored.snapshot or {}
    for journal in stored.journals:
        for payload in journal.records:
            decode_change(payload, str(journal.path)).apply_to(entries)
    return entries


def _highest_seq(entries: Mapping[str, ManifestEntry]) -> int:
    return max((e.seq for e in entries.values()), default=0)


def upgrade(manifest: Manifest, layout: Layout) -> int:
    """Record what each file is (ManifestEntry.layout, unit, members, role, seq) in entries written before
    the record said, as one change; returns how many. The layout is the one in force, which named these
    files when they were copied. Their order is the order of their sources' mtimes, the evidence there was."""
    from mirrord.core.units import recorded_as

    units: dict[str, list[ManifestEntry]] = defaultdict(list)  # unit key -> its files
    for e in manifest.entries.values():
        if not e.layout:
            units[recorded_as(e.path, layout)["unit"] or e.path].append(e)
    order = sorted(units, key=lambda key: (max(e.source_mtime_ns for e in units[key]), key))
    first = manifest.next_seq(len(order))
    puts = [
        replace(e, **recorded_as(e.path, layout, len(units[key])), seq=seq, seen=seq - 1)
        for seq, key in enumerate(order, first)
        for e in units[key]
    ]
    manifest.apply(puts=puts)
    return len(puts)


# -- the manifest -------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Pending:
    change: Change
    payload: bytes
    done: bool = False
    error: BaseException | None = None


class ManifestStore(Protocol):
    """Where a writable Manifest makes its changes durable; each implementation of the mirror has one.

    Local (mirrord.store.journal.LocalManifestStore): a snapshot file and append-only journals. An
    object store keeps the same shape with conditional PUTs (two writers never overwrite each other).
    Manifest serialises the calls: one append or one compaction step at a time.
    """

    journal_records: int  # records appended since the last rotate(): the compaction policy reads it

    def append(self, payloads: Iterable[bytes]) -> None:
        """Make these change records durable together, or raise (then none of them counts)."""

    def rotate(self) -> int:
        """Compaction step 1: appends go to a new journal from now on; returns its generation."""

    def publish_snapshot(self, data: bytes) -> None:
        """Compaction step 2: the snapshot of everything recorded before that rotation."""

    def drop_before(self, generation: int) -> None:
        """Compaction step 3: remove the journals that snapshot made stale."""

    def damage(self) -> str | None:
        """What changed in the stored manifest behind this process's back, or None."""

    def shared_entries(self) -> dict[str, ManifestEntry] | None:
        """Every entry as stored now, other writers' included, for a store several writers share (an
        object store with several nodes); None for a store only this process writes (local)."""


@runtime_checkable
class SharedUnitsStore(Protocol):
    """A manifest store several nodes share that also keeps their contributions to folder units not
    complete yet (mirrord.core.contributions): the object store's."""

    def contributions(self) -> dict[str, dict[str, Contribution]]:
        """The contributions as last read or written."""

    def contribute(self, unit: str, part: Contribution) -> Merged:
        """Record `part` into the stored manifest (read, merge, conditional write; again on a conflict)."""


class Manifest:
    """Entries keyed by root-relative POSIX path; thread-safe.

    With a store, apply() returns once its change is durable (or raises, and nothing changed in
    memory); concurrent changes are written in the order they were made.
    """

    def __init__(
        self,
        entries: dict[str, ManifestEntry] | None = None,
        store: ManifestStore | None = None,
        background_compaction: bool = True,
        contributions: Contributions | None = None,
    ) -> None:
        self._entries: dict[str, ManifestEntry] = dict(entries or {})
        self.matched: Matched = {}  # this node's sources hashed against other nodes' entries (core.nodes)
        self._lock = threading.Lock()  # the entries and the queue of pending changes
        self._commit = threading.Lock()  # one writer of the journal at a time
        self._queue: list[_Pending] = []
        self._store = store
        self._compacting = False
        # Compaction rewrites every entry: off the thread whose change triggered it,
        # so neither a copy worker nor the daemon's main loop waits for it.
        self._background = background_compaction
        self._compactor: threading.Thread | None = None
        self._contributions = contributions or {}  # a read-only view's (a shared store's are the store's)
        self._seq = _highest_seq(self._entries)  # the last recording sequence given (ManifestEntry.seq)

    @property
    def entries(self) -> Mapping[str, ManifestEntry]:
        """A copy: callers plan from a consistent view while workers keep recording."""
        with self._lock:
            return dict(self._entries)

    def get(self, rel: str) -> ManifestEntry | None:
        """The entry for `rel`, if recorded."""
        with self._lock:
            return self._entries.get(rel)

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, entry: ManifestEntry) -> None:
        """Add or replace an entry; durable when this returns."""
        self.apply(puts=(entry,))

    def remove(self, rel: str) -> None:
        """Drop an entry; durable when this returns."""
        self.apply(removes=(rel,))

    def apply(self, puts: Iterable[ManifestEntry] = (), removes: Iterable[str] = ()) -> None:
        """Record entries and drop paths as one record: after a crash, either all of it or none."""
        change = Change(tuple(puts), tuple(removes))
        if {e.path for e in change.puts} & set(change.removes):
            raise ValueError("a path cannot be recorded and removed in the same change")
        pending = _Pending(change, b"" if self._store is None else change.encode())  # (encoded outside the locks)
        with self._lock:
            if not change.puts and not any(r in self._entries for r in change.removes):
                return  # nothing changes, nothing is written
            if self._store is None:
                change.apply_to(self._entries)
                return
            self._queue.append(pending)
        with self._commit:
            if not pending.done:  # else a writer that got the lock first took ours with its own
                self._write_queued()
        if pending.error is not None:
            if isinstance(self._store, LocalManifestStore):
                # The failed records may be in the journal: a snapshot of what was acknowledged makes that
                # journal stale, so a load (a restart) never replays a change its caller was told failed.
                self._compact_quietly()
            raise pending.error
        self._maybe_compact()

    @property
    def last_seq(self) -> int:
        """The last recording sequence given on this mirror (ManifestEntry.seen of a source listed now)."""
        return self._seq

    def next_seq(self, count: int = 1) -> int:
        """The recording sequence (ManifestEntry.seq) of the next unit recorded (the first of the next `count`):
        one more than any given or recorded on this mirror."""
        with self._lock:
            self._seq += count
            return self._seq - count + 1

    def _write_queued(self) -> None:
        """With the commit lock: write every queued change in one append, then apply them in order."""
        assert self._store is not None
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            self._store.append(p.payload for p in batch)
        except BaseException as exc:
            for p in batch:
                p.error, p.done = exc, True
            return
        with self._lock:
            for p in batch:
                p.change.apply_to(self._entries)
                p.done = True

    @property
    def contributions(self) -> Contributions:
        """Nodes' contributions to folder units that are not complete yet (a shared object store's; else none)."""
        store = self._store
        return store.contributions() if isinstance(store, SharedUnitsStore) else self._contributions

    def contribute(self, unit: str, part: Contribution) -> Merged:
        """Record this node's part of a folder unit written by several nodes. When the parts now make the
        whole unit, all of its files are recorded as entries by the same write (the unit's commit point:
        `puts`). Durable when this returns; `verdict` says whether the unit is complete and why (or what
        is missing)."""
        store = self._store
        if not isinstance(store, SharedUnitsStore):
            raise ManifestError(MANIFEST_NAME, "only an object-store mirror records parts of a unit from several nodes")
        with self._commit:  # no queued change of ours is half-applied meanwhile
            merged = store.contribute(unit, part)
            with self._lock:
                Change(merged.puts, merged.removes).apply_to(self._entries)
        return merged

    # -- compaction -----------------------------------------------------------------------------------
    def _maybe_compact(self) -> None:
        store = self._store
        if (
            store is None
            or self._compacting
            or store.journal_records < max(COMPACT_MIN_RECORDS, len(self._entries) // 4)
        ):
            return
        if not self._background:
            self._compact_quietly()
            return
        with self._lock:
            if self._compactor is not None and self._compactor.is_alive():
                return
            self._compactor = threading.Thread(
                target=self._compact_quietly, name="mirrord-manifest-compaction", daemon=True
            )  # killed at exit mid-way: each step is crash-safe
            self._compactor.start()

    def _compact_quietly(self) -> None:
        """After a durable change: a failed compaction is logged and tried again later, never raised."""
        try:
            self.compact()
        except MirrordError as exc:  # a bug is left to the thread's excepthook; the next change retries
            get_logger().error("manifest.compaction_failed", path=exc.path, cause=exc.cause)
        except OSError as exc:
            get_logger().error("manifest.compaction_failed", path=exc.filename or "", cause=exc.strerror or str(exc))

    def compact(self) -> None:
        """Fold the journal into a new snapshot (see mirrord.store.journal for the steps and their crash safety).

        Only the rotation holds the commit lock; writing the snapshot does not stop appends.
        """
        store = self._store
        if store is None:
            return
        with self._commit:
            if self._compacting:
                return
            with self._lock:
                held = dict(self._entries)  # all committed: the journal is written under this lock
            generation = store.rotate()
            self._compacting = True  # (set under the commit lock, which disk_problem() takes to be sure)
        try:
            store.publish_snapshot(encode_snapshot(held, generation))
            store.drop_before(generation)
        finally:
            self._compacting = False

    def refresh(self) -> None:
        """Take in what other writers recorded since (a shared store: several nodes, one prefix), so that
        retention plans from the merged manifest. Our own changes are already in the store, so nothing
        is lost; a store only we write has nothing to take in."""
        with self._commit:  # no change of ours is half-applied meanwhile
            shared = None if self._store is None else self._store.shared_entries()
            if shared is not None:
                with self._lock:
                    self._entries = dict(shared)
                    self._seq = max(self._seq, _highest_seq(shared))

    def disk_problem(self) -> str | None:
        """What happened to the on-disk manifest behind our back (None: it is what we wrote)."""
        store = self._store
        if store is None or self._compacting:
            return None  # (a compaction publishes its snapshot outside the commit lock)
        with self._commit:
            return None if self._compacting else store.damage()

    def close(self) -> None:
        """Fold the journal into the snapshot, so that a stopped mirror is one complete JSON file."""
        if self._compactor is not None:
            self._compactor.join()
        if self._store is not None and self._store.journal_records:
            self.compact()

    @classmethod
    def load(cls, root: Path) -> Manifest:
        """Read the manifest of a local mirror root (snapshot + journal), read-only; empty if none yet."""
        return cls(_replay(LocalManifestStore(root, MANIFEST_NAME, read_only=True).read(decode_snapshot)))

    @classmethod
    def open(cls, root: Path, background_compaction: bool = True, guard: Callable[[], None] | None = None) -> Manifest:
        """The manifest of a local mirror root, for the process holding its lock: changes are journaled.

        Nothing is written until the first change; on a root without a snapshot, that change publishes an
        empty one first, so that a journal never exists without it. `guard` is called before every write
        (it raises to refuse it).
        """
        store = LocalManifestStore(root, MANIFEST_NAME, guard=guard)
        stored = store.read(decode_snapshot)
        store.open_for_append(stored, encode_snapshot({}))
        return cls(_replay(stored), store, background_compaction)
