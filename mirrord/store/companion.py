"""A binary companion of the manifest snapshot: the same entries, loaded in a fraction of the JSON's time.

    .mirrord-manifest.json     the snapshot: the source of truth, what every tool reads
    .mirrord-manifest.packed   its companion: each entry as mirrord.store.packed holds it in memory

Parsing 100,000 JSON entries takes over a second; the companion's entries are already in their packed
form, so a load is a few slices and one unpack each. The companion names the SHA-256 of the snapshot it
was made from and is used only while the snapshot on disk has exactly that digest (the snapshot is
hashed as it is read anyway, for mirrord.store.journal's damage check), and its own body is checksummed.
Anything else (missing, stale, torn, a stranger's file) makes the reader parse the JSON, with a log
line: the companion can make a load faster, never different. It is published after its snapshot by the
same atomic protocol; a crash in between leaves a stale companion, which is ignored.

Layout (integers little-endian):

    MAGIC, then HEADER: version, snapshot SHA-256, body SHA-256, generation, entries, paths bytes
    body: the paths (UTF-8, lone surrogates kept, NUL-separated: a path never holds NUL),
          the end offset of each record (uint32), the records (mirrord.store.packed's bytes)
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Iterable, Mapping
from operator import itemgetter
from sys import intern
from typing import TYPE_CHECKING, Any, NamedTuple

from mirrord.core.model import ManifestEntry
from mirrord.store.hashing import ALGORITHMS
from mirrord.store.packed import NO_MIRROR_MTIME, NO_STEP, RECORD_LAYOUT, VERDICTS, Held, pack, unpack

if TYPE_CHECKING:
    import hashlib  # (imported where a companion is written or read: most manifests have none)

MAGIC = b"mirrord-manifest-packed\n"
VERSION = 1
_HEADER = struct.Struct("<I32s32sQQQ")
# A smaller manifest parses fast enough as JSON: no second file to write at each compaction.
COMPANION_FROM_ENTRIES = 4096
_READ_BYTES = 1 << 20  # of paths
_BATCH = 1 << 13  # records read, sliced and unpacked together
_RECORD_MIN = RECORD_LAYOUT.size + 1  # the fixed fields and a digest
_first = itemgetter(0)
# Sequences no path list of split_rel-valid paths contains once NUL-joined and NUL-framed: an empty part,
# an absolute path, a trailing slash, '.' or '..' as a part.
_UNSAFE = ("\0\0", "\0/", "/\0", "//", "/./", "/../", "\0./", "\0../", "/.\0", "/..\0", "\0.\0", "\0..\0")


class CompanionError(ValueError):
    """The companion cannot be used; the message says why (the caller parses the JSON instead)."""


# (A NamedTuple, not a dataclass: see mirrord.core.branches.Branches.)
class Companion(NamedTuple):
    """A companion as read: its snapshot's entries and generation, and the SHA-256 of that snapshot."""

    entries: dict[str, Held]
    generation: int
    snapshot_sha256: bytes


def companion_name(snapshot_name: str) -> str:
    """The companion's file name beside the snapshot `snapshot_name`."""
    return snapshot_name.removesuffix(".json") + ".packed"


def encode_companion(entries: Mapping[str, Held], generation: int, snapshot_sha256: bytes) -> bytes | None:
    """The companion of the snapshot with this digest, holding `entries` (path -> packed bytes or entry);
    None when an entry does not pack back to itself (then only the JSON holds it)."""
    import hashlib

    paths = sorted(entries)
    records = []
    for path in paths:
        held = entries[path]
        packed = held if type(held) is bytes else pack(unpack(path, held))
        if type(packed) is not bytes:
            return None
        records.append(packed)
    try:
        text = "\0".join(paths).encode("utf-8", "surrogatepass")
    except UnicodeEncodeError:
        return None
    ends = array("I")
    end = 0
    for r in records:
        end += len(r)
        ends.append(end)
    if end >= 1 << 32:
        return None  # (4 GiB of records: ~40 million entries)
    if sys.byteorder != "little":
        ends.byteswap()
    body = hashlib.sha256(text)
    body.update(ends)
    for r in records:
        body.update(r)
    header = _HEADER.pack(VERSION, snapshot_sha256, body.digest(), generation, len(paths), len(text))
    return b"".join((MAGIC, header, text, ends.tobytes(), *records))  # (one copy of the records, not two)


def counted_entries(path: str | os.PathLike[str]) -> int:
    """How many entries the companion at `path` says it holds, from its header alone: a hint (nothing is
    checked against its snapshot), 0 when there is no companion there or it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        count: int = _header(_read_exactly(fd, len(MAGIC) + _HEADER.size))[4]
    except (OSError, CompanionError):
        return 0
    finally:
        os.close(fd)
    return count


def _header(head: bytes) -> tuple[Any, ...]:
    """(version, snapshot SHA-256, body SHA-256, generation, entries, paths bytes) from a companion's first
    bytes; CompanionError if they are not a companion's."""
    if not head.startswith(MAGIC):
        raise CompanionError("not a mirrord manifest companion")
    return _HEADER.unpack_from(head, len(MAGIC))


def read_companion(fd: int, packed_from: int) -> Companion:
    """The companion open at `fd`, its entries unpacked into ManifestEntry objects below `packed_from`
    entries and kept packed from there on (as mirrord.store.manifest.read_snapshot holds them).
    CompanionError for anything that is not a whole, intact companion of this version."""
    version, snapshot_sha256, body_sha256, generation, count, text_bytes = _header(
        _read_exactly(fd, len(MAGIC) + _HEADER.size))
    if version != VERSION:
        raise CompanionError(f"unsupported companion version {version}")
    import hashlib

    body = hashlib.sha256()
    paths = _read_paths(fd, text_bytes, body) if count else []
    if len(paths) != count:
        raise CompanionError("it does not hold the listed number of paths")
    raw = _read_exactly(fd, 4 * count)
    body.update(raw)
    ends = array("I")
    ends.frombytes(raw)
    if sys.byteorder != "little":
        ends.byteswap()
    del raw
    entries: dict[str, Held] = {}
    put = entries.update
    start = 0  # of the batch's first record, in the records
    for first in range(0, count, _BATCH):  # a batch at a time: the records are never whole in memory
        batch_ends = ends[first:first + _BATCH]
        end = batch_ends[-1]
        # Records of one length (digests of one length: one algorithm), the usual case, are unpacked by one
        # call for the whole batch; their offsets are checked as exactly that (one comparison, in C).
        size = (end - start) // len(batch_ends) if end > start else 0
        uniform = size >= _RECORD_MIN and batch_ends == array("I", range(start + size, end + 1, size))
        if not uniform:
            starts = [start, *batch_ends[:-1]]
            if end < start or any(map(int.__gt__, starts, batch_ends)):
                raise CompanionError("its record offsets go backwards")
        raw = _read_exactly(fd, end - start)
        body.update(raw)
        names = map(intern, paths[first:first + _BATCH])
        try:
            if uniform and count >= packed_from:
                put(zip(names, map(_first, struct.iter_unpack(f"<{size}s", raw)), strict=True))
            elif uniform:  # the fixed fields and the digest of every record
                _unpack_into(entries, names, struct.iter_unpack(f"{RECORD_LAYOUT.format}{size - RECORD_LAYOUT.size}s",
                                                                raw))
            else:
                records = [raw[a - start:b - start] for a, b in zip(starts, batch_ends, strict=True)]
                if min(map(len, records)) < _RECORD_MIN:
                    raise CompanionError("a record is too short")
                if count >= packed_from:
                    put(zip(names, records, strict=True))
                else:
                    _unpack_into(entries, names, map(_split, records))
        except (struct.error, IndexError) as exc:
            raise CompanionError(f"a record does not unpack: {exc}") from None
        start = end
    if len(entries) != count:
        raise CompanionError("it names a path twice")
    if os.read(fd, 1):
        raise CompanionError("it has data after its records")
    if body.digest() != body_sha256:
        raise CompanionError("its checksum does not match (damaged?)")
    return Companion(entries, generation, snapshot_sha256)


def _read_paths(fd: int, size: int, body: hashlib._Hash) -> list[str]:
    """The NUL-separated paths of the next `size` bytes, read a chunk at a time (at 1,000,000 entries their
    text is 27 MB that would add to a reconcile's peak) and each held to split_rel's rule."""
    paths: list[str] = []
    carry = b""
    while size > 0:
        raw = _read_exactly(fd, min(size, _READ_BYTES))
        size -= len(raw)
        body.update(raw)
        raw = carry + raw
        cut = len(raw) if size == 0 else raw.rfind(b"\0")
        if cut < 0:
            carry = raw  # a path longer than a chunk
            continue
        carry = raw[cut + 1:]
        try:
            text = raw[:cut].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CompanionError(f"paths are not UTF-8: {exc}") from None
        if not _safe(text):
            raise CompanionError("its paths are not all safe relative paths")
        paths += text.split("\0")
    return paths


def _safe(text: str) -> bool:
    """Whether every one of the NUL-separated paths `text` holds is one split_rel accepts, checked on the
    whole text at once (no copy of it): inside it, then where its first and last paths meet the frame."""
    if len(text) <= 8:
        return not any(bad in f"\0{text}\0" for bad in _UNSAFE)
    head, tail = f"\0{text[:3]}", f"{text[-3:]}\0"  # (a pattern is at most 4 characters long)
    return not any(bad in text or bad in head or bad in tail for bad in _UNSAFE)


def _split(record: bytes) -> tuple[Any, ...]:
    """A record's fixed fields and its digest, as the batch unpack of records of one length gives them."""
    return (*RECORD_LAYOUT.unpack_from(record), record[RECORD_LAYOUT.size:])


def _unpack_into(entries: dict[str, Held], paths: Iterable[str], records: Iterable[tuple[Any, ...]]) -> None:
    """entries[path] = the ManifestEntry of each record's fields (mirrord.store.packed.unpack, inlined)."""
    algos, verdicts, make = ALGORITHMS, VERDICTS, ManifestEntry
    for path, (size, mtime, step, at, mirror_mtime, ino, ctime, algo, verdict, flags, digest) in zip(
            paths, records, strict=True):
        entries[path] = make(path, size, algos[algo], digest.hex(), mtime, None if flags & NO_STEP else step, at,
                             None if flags & NO_MIRROR_MTIME else mirror_mtime, verdicts[verdict], ino, ctime)


def _read_exactly(fd: int, n: int) -> bytes:
    parts = []
    while n > 0:
        part = os.read(fd, min(n, 1 << 24))
        if not part:
            raise CompanionError("it ends early (torn?)")
        parts.append(part)
        n -= len(part)
    return b"".join(parts)
