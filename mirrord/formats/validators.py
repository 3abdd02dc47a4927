"""Format validators: is this file a whole checkpoint, or a torn / corrupt one under a final name?

A copy counts only when its source passes its format's validator. Validators are fed the bytes the
copier streams anyway (`feed`), so a torn or corrupt source costs no second read; `finish` may pread
a few small structures (a zip's central directory, local headers, and at most 8 KiB at each record
boundary) from the same descriptor.
Standard library only.

    torch zip     a file that begins with the zip local-header signature must be a whole zip: end
                  records present, every record where the directory says, every record's CRC-32 right
    safetensors   8-byte header length, a JSON header, tensor data offsets that cover the file exactly
    json          parses
    dcp           `.metadata`: a torch.distributed.checkpoint Metadata, read without running the pickle
                  (mirrord.formats.dcpmeta); with its folder (validate_beneath), every file it references
                  present with its size. A `.distcp` data file is judged against the `.metadata` beside it.

The validator is chosen by the file name first (.safetensors, .json, .metadata, .distcp), then by the
first bytes (a zip): a .distcp starts with a torch zip but is many of them end to end, and is not one.
Anything else (a legacy pickle, a zip that torch did not write, an unknown format) is *unchecked*:
mirrored as before, never called broken. An empty file is always *empty*, whatever its name.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mirrord.formats import dcpmeta, zipcheck
from mirrord.formats.verdicts import EMPTY, INVALID, OK, PASSING, TRUNCATED, UNCHECKED, UNREADABLE

TORCH_ZIP, SAFETENSORS, JSON, DCP = "torch_zip", "safetensors", "json", dcpmeta.FORMAT

_SIG_LOCAL = b"PK\x03\x04"
_MAX_BUFFERED = 64 * 1024 * 1024  # JSON files and safetensors headers larger than this are unchecked


@dataclass(frozen=True, slots=True)
class Verdict:
    """A validator's answer. `passed` (ok or unchecked) is what publishing requires."""

    status: str
    detail: str
    format: str | None = None

    @property
    def passed(self) -> bool:
        """Whether the file may be published (whole, or of a format nothing can check)."""
        return self.status in PASSING

    def __str__(self) -> str:
        return f"{self.status}: {self.detail}" if self.detail else self.status


class Validator(Protocol):
    """A streaming check fed the file's bytes as they are copied; its verdict comes at the end."""

    def feed(self, buf: bytes | bytearray | memoryview, n: int) -> None:
        """The next `n` bytes of the file (from offset 0, in order) are buf[:n]."""

    def finish(self, fd: int) -> Verdict:
        """The verdict once every byte was fed; `fd` is the same file, for small preads."""


class _TorchZip:
    """Streams a zip and checks every stored record's CRC-32 on the bytes as they go by.

    With the source's descriptor, the central directory is read before the first byte is streamed (a
    committed checkpoint is whole: its end records are there): the records' data ranges are then
    known, and each range's CRC is computed straight from the streamed buffers, a few calls per
    buffer. At the end the directory is read again; only if it still names the same records at the
    same places do those CRCs count. Otherwise (no descriptor, a directory that could not be read
    first, or one that moved while the file was copied) the records are checksummed by reading them
    back: a second read, for a torn or rewritten file only.
    """

    format = TORCH_ZIP

    def __init__(self, fd: int | None = None) -> None:
        self.size = 0
        self._plan = _plan_records(fd) if fd is not None else None
        self._next = 0  # the plan's first stored record whose data is not all streamed yet
        self._record_crc = 0  # of the streamed part of that record
        self._crcs: list[int] = []  # of the plan's stored records, in file order, once streamed

    def feed(self, buf: bytes | bytearray | memoryview, n: int) -> None:
        first, last = self.size, self.size + n
        self.size = last
        if self._plan is None:
            return
        view = memoryview(buf)
        ranges = self._plan[1]
        while self._next < len(ranges):
            start, end = ranges[self._next]
            if start >= last:
                break
            a, b = max(start, first), min(end, last)
            if a < b:
                self._record_crc = zipcheck.crc32(view[a - first : b - first], self._record_crc)
            if end > last:
                break
            self._crcs.append(self._record_crc)
            self._record_crc = 0
            self._next += 1

    def finish(self, fd: int) -> Verdict:
        try:
            records, ranges = zipcheck._layout(fd, self.size)
            known: dict[tuple[int, int], int] = {}
            if self._plan == (self.size, _stored(records, ranges)):
                known = dict(zip(self._plan[1], self._crcs, strict=True))
            return _from_zipcheck(zipcheck._verify_crcs(fd, records, ranges, known))
        except zipcheck._BadFileError as bad:
            return _from_zipcheck(bad.result)
        except OSError as exc:
            return Verdict(UNREADABLE, f"read failed: {exc.strerror or exc}", TORCH_ZIP)


def _stored(records: list[zipcheck._Record], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The data ranges of the stored (uncompressed) records, in file order."""
    return sorted(rng for r, rng in zip(records, ranges, strict=True) if r.method == 0)


def _plan_records(fd: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where the stored records' data of the file behind `fd` lie now, with its size; None if its directory
    cannot be read (a torn or foreign file: it is judged at the end, its records read back)."""
    try:
        size = os.fstat(fd).st_size
        stored = _stored(*zipcheck._layout(fd, size))
    except (zipcheck._BadFileError, OSError):
        return None
    if len(set(stored)) != len(stored):
        return None  # two records on the same bytes: judged by reading them back
    return size, stored


class _Safetensors:
    """Keeps only the header: 8-byte little-endian length, then that many bytes of JSON."""

    format = SAFETENSORS

    def __init__(self) -> None:
        self.size = 0
        self._head = bytearray()
        self._need = 8

    def feed(self, buf: bytes | bytearray | memoryview, n: int) -> None:
        pos = 0
        while pos < n and len(self._head) < self._need:
            take = min(n - pos, self._need - len(self._head))
            self._head += buf[pos : pos + take]
            pos += take
            if self._need == 8 and len(self._head) == 8:
                self._need = 8 + min(struct.unpack("<Q", self._head)[0], _MAX_BUFFERED + 1)
        self.size += n

    def finish(self, fd: int) -> Verdict:
        return safetensors_verdict(bytes(self._head), self.size)


def safetensors_verdict(head: bytes, size: int) -> Verdict:
    """Judge a safetensors file from its first bytes (at least the header) and its size."""

    def bad(status: str, detail: str) -> Verdict:
        return Verdict(status, detail, SAFETENSORS)

    if size < 8:
        return bad(TRUNCATED, f"{size} bytes: shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", head[:8])
    if length > _MAX_BUFFERED:
        return Verdict(UNCHECKED, f"header of {length} bytes is larger than mirrord checks", SAFETENSORS)
    if 8 + length > size:
        return bad(TRUNCATED, f"header of {length} bytes runs past the end ({size})")
    try:
        header = json.loads(head[8 : 8 + length])
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        return bad(INVALID, f"header is not JSON: {exc}")
    if not isinstance(header, dict):
        return bad(INVALID, "header is not a JSON object")
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            first, last = info["data_offsets"]
            spans.append((int(first), int(last), name))
        except (TypeError, KeyError, ValueError):
            return bad(INVALID, f"tensor {name!r} has no valid data_offsets")
    data = size - 8 - length
    at = 0
    for first, last, name in sorted(spans):
        if first != at or last < first:
            return bad(INVALID, f"tensor {name!r} starts at {first}, expected {at} (gap or overlap)")
        at = last
    if at != data:
        status = TRUNCATED if at > data else INVALID
        return bad(status, f"tensors cover {at} data bytes, the file holds {data}")
    return Verdict(OK, f"{len(spans)} tensors cover the file exactly", SAFETENSORS)


class _Buffered:
    """Keeps a whole file of at most `limit` bytes to `judge` at the end; of a larger one, only its size."""

    limit: int
    format: str

    def __init__(self) -> None:
        self.size = 0
        self._data = bytearray()

    def feed(self, buf: bytes | bytearray | memoryview, n: int) -> None:
        if self.size + n <= self.limit:
            self._data += buf[:n]
        self.size += n

    def finish(self, fd: int) -> Verdict:
        if self.size > self.limit:
            return Verdict(UNCHECKED, f"{self.size} bytes: larger than mirrord reads", self.format)
        return self.judge(bytes(self._data))

    def judge(self, data: bytes) -> Verdict:
        """The verdict on the whole file's bytes."""
        raise NotImplementedError


class _Json(_Buffered):
    format = JSON
    limit = _MAX_BUFFERED

    def judge(self, data: bytes) -> Verdict:
        try:
            json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            return Verdict(INVALID, f"not JSON: {exc}", JSON)
        return Verdict(OK, "parses", JSON)


class _DcpMetadata(_Buffered):
    """A DCP `.metadata`: the pickle's structure is read (never run); its data files are not seen here."""

    format = DCP
    limit = dcpmeta.MAX_METADATA_BYTES

    def judge(self, data: bytes) -> Verdict:
        try:
            needed = dcpmeta.storage_references(data)
        except dcpmeta.MetadataError as exc:
            return Verdict(exc.status, f"{dcpmeta.METADATA_NAME}: {exc}", DCP)
        return Verdict(OK, f"references {len(needed)} file(s) (checked with its folder)", DCP)


class _Sniff:
    """Picks the validator from the name and the first bytes; empty files and unknown formats need none."""

    def __init__(self, name: str, fd: int | None = None) -> None:
        self.name = name
        self._fd = fd
        self.size = 0
        self._inner: Validator | None = None
        self._head = b""
        self._decided = False

    def feed(self, buf: bytes | bytearray | memoryview, n: int) -> None:
        self.size += n
        if not self._decided:
            if len(self._head) + n < 64:  # too little to decide on yet: keep it
                self._head += bytes(buf[:n])
                return
            earlier = self._head
            self._head += bytes(buf[: 64 - len(earlier)])
            self._decide(earlier)
        if self._inner is not None:
            self._inner.feed(buf, n)

    def _decide(self, seen: bytes) -> None:
        """Choose on the first 64 bytes (or all of a shorter file), then feed the bytes `seen` before."""
        self._decided = True
        factory = _factory(self.name, self._head)
        self._inner = _TorchZip(self._fd) if factory is _TorchZip else factory() if factory else None
        if self._inner is not None and seen:
            self._inner.feed(seen, len(seen))

    def finish(self, fd: int) -> Verdict:
        if self.size == 0:
            return Verdict(EMPTY, "0 bytes: nothing was written (yet)")
        if not self._decided:  # a file shorter than 64 bytes: everything it holds is in _head
            self._decide(self._head)
        if self._inner is None:
            return unchecked(self.name, self._head)
        return self._inner.finish(fd)


def _factory(name: str, head: bytes) -> Callable[[], Validator] | None:
    base = name.rsplit("/", 1)[-1]
    lower = base.lower()
    if lower.endswith(".safetensors"):
        return _Safetensors
    if lower.endswith(".json"):
        return _Json
    if base == dcpmeta.METADATA_NAME:
        return _DcpMetadata
    if lower.endswith(dcpmeta.DATA_SUFFIX):
        return None  # judged with its folder's .metadata (validate_beneath), never as one zip
    if head.startswith(_SIG_LOCAL):
        return _TorchZip
    return None


def unchecked(name: str, head: bytes) -> Verdict:
    """The verdict for a file no validator knows: published, marked unchecked, with what it looks like."""
    if name.lower().endswith(dcpmeta.DATA_SUFFIX):
        return Verdict(UNCHECKED, f"a DCP data file: checked against the {dcpmeta.METADATA_NAME} beside it", DCP)
    if head.startswith(b"\x80"):
        detail = zipcheck._classify_non_zip(head).detail
    else:
        detail = f"no validator for {name.rsplit('/', 1)[-1]!r} (starts with {head[:8].hex()})"
    return Verdict(UNCHECKED, detail)


def new_validator(name: str, fd: int | None = None) -> Validator:
    """A validator for the file called `name`, to be fed its bytes in order. With `fd` (the same file,
    for small preads), a torch zip's directory is read before the bytes stream by: its records are
    then checksummed in a few calls per buffer (see _TorchZip)."""
    return _Sniff(name, fd)


def _from_zipcheck(found: zipcheck.ZipCheck) -> Verdict:
    status = {"ok": OK, "not_torch_zip": UNCHECKED, "legacy_pickle": UNCHECKED}.get(found.status, found.status)
    return Verdict(status, found.detail, TORCH_ZIP)


def validate_fd(fd: int, name: str, quick: bool = False) -> Verdict:
    """Validate a whole open file by reading it (verify --deep, latest, status). The offset is untouched.

    `quick` checks structure only (a torch zip's end records and headers, not its CRCs): it reads a few
    kilobytes, enough to catch a truncated file, for callers that must stay cheap.
    """
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Verdict(UNREADABLE, "not a regular file")
        if st.st_size == 0:
            return Verdict(EMPTY, "0 bytes: nothing was written (yet)")
        head = os.pread(fd, 64, 0)
        factory = _factory(name, head)
        if factory is _TorchZip:
            return _from_zipcheck(zipcheck.check_torch_zip_fd(fd, crcs=not quick))
        if factory is None:
            return unchecked(name, head)
        if factory is _Safetensors:
            length = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
            return safetensors_verdict(os.pread(fd, 8 + min(length, _MAX_BUFFERED + 1), 0), st.st_size)
        validator = factory()
        assert isinstance(validator, _Buffered)  # the rest (JSON, a DCP .metadata) judge the whole file
        if st.st_size > validator.limit:
            validator.size = st.st_size  # (its finish says it is too large to read)
            return validator.finish(fd)
        return validator.judge(os.pread(fd, st.st_size, 0))
    except OSError as exc:
        return Verdict(UNREADABLE, f"read failed: {exc.strerror or exc}")
