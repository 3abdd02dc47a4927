"""Deep verification of torch.save checkpoints, with the standard library only (torch is never imported).

torch.save writes a zip archive whose records (data.pkl, one record per tensor storage, ...) each
carry a CRC-32. Recomputing every record's CRC catches truncation and bit rot without a manifest:
exactly the question "may I resume from this file?" on a primary that mirrord did not write.

Statuses:
  ok             every record is present and matches its CRC-32
  truncated      the file ends before data its own structure promises (a write or copy cut short)
  crc_mismatch   the structure is intact but a record's bytes do not match its CRC-32 (bit rot)
  not_torch_zip  readable, but not a torch.save zip archive (other data, no data.pkl, unsupported zip)
  legacy_pickle  the pre-1.6 format (_use_new_zipfile_serialization=False): no checksums to verify
  unreadable     an I/O error, or zip headers so damaged that the records cannot be located

Reading is streamed with pread through one fixed buffer (never mmap: a file truncated while mapped
would kill the process with SIGBUS).
"""

from __future__ import annotations

import os
import stat
import struct
import typing
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

Status = Literal["ok", "truncated", "crc_mismatch", "not_torch_zip", "legacy_pickle", "unreadable"]
STATUSES: tuple[Status, ...] = typing.get_args(Status)

try:  # ISA-L's CRC-32 (python-isal): the same function as zlib's, several times faster
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # pragma: no cover - a platform without its wheel
    from zlib import crc32 as crc32

# Records are read and checksummed this much at a time.
PIECE_BYTES = 8 * 1024 * 1024

# torch.serialization.MAGIC_NUMBER as the pickle LONG1 opcode writes it: the first object of a legacy file.
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")

_LOCAL = struct.Struct("<4sHHHHHLLLHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<4sHHHHHHLLLHHHHHLL")  # central directory file header, 46 bytes
_EOCD = struct.Struct("<4sHHHHLLH")  # end of central directory, 22 bytes
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes, immediately before the EOCD
_ZIP64_EOCD = struct.Struct("<4sQHHLLQQQQ")  # 56 bytes
_SIG_LOCAL = b"PK\x03\x04"
_SIG_CENTRAL = b"PK\x01\x02"
_SIG_EOCD = b"PK\x05\x06"
_SIG_ZIP64_LOCATOR = b"PK\x06\x07"
_SIG_ZIP64_EOCD = b"PK\x06\x06"
_MAX_COMMENT = 0xFFFF
_STORED, _DEFLATED = 0, 8
_FLAG_ENCRYPTED, _FLAG_UTF8 = 0x1, 0x800


@dataclass(frozen=True, slots=True)
class ZipCheck:
    """The verdict on one file; `detail` names the record or offset concerned, for a person to read."""

    status: Status
    detail: str

    @property
    def ok(self) -> bool:
        """Whether the zip is whole and every member's CRC matches."""
        return self.status == "ok"


class _Record(NamedTuple):
    name: str
    method: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int


class _BadFileError(Exception):
    """Raised inside the check to stop at the first finding; carries the result."""

    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.result = ZipCheck(status, detail)


def check_torch_zip(path: str | os.PathLike[str]) -> ZipCheck:
    """Verify the zip structure of a torch.save file and the CRC-32 of every record.

    Never raises for a bad or missing file: every problem becomes a status.
    """
    try:
        # O_NONBLOCK so that a FIFO in place of a checkpoint is reported, not waited on forever.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        return ZipCheck("unreadable", f"cannot open: {exc.strerror or exc}")
    try:
        return check_torch_zip_fd(fd)
    finally:
        os.close(fd)


def check_torch_zip_fd(fd: int, crcs: bool = True) -> ZipCheck:
    """check_torch_zip on a file the caller already opened (e.g. safely beneath a root); fd stays open.

    Reads with pread only, so the fd's offset is left where it was. Without `crcs`, the structure only (end
    records, every local header where the directory says): a few kilobytes read, enough to catch a cut.
    """
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ZipCheck("unreadable", "not a regular file")
        if st.st_size == 0:
            return ZipCheck("truncated", "empty file")
        head = os.pread(fd, 64, 0)
        if not head.startswith(_SIG_LOCAL):
            return _classify_non_zip(head)
        records, ranges = _layout(fd, st.st_size)
        if not crcs:
            return ZipCheck("ok", f"{len(records)} records where the directory says (CRCs not read)")
        return _verify_crcs(fd, records, ranges)
    except _BadFileError as verdict:
        return verdict.result
    except OSError as exc:
        return ZipCheck("unreadable", f"read failed: {exc.strerror or exc}")


def load_check(path: str | os.PathLike[str]) -> ZipCheck:
    """Prove the file deserializes: torch.load on the CPU, tensors memory-mapped, no arbitrary pickles.

    Meant to run after check_torch_zip says "ok" (mmap loading needs the zip format). Raises
    ModuleNotFoundError when torch is not installed: that is a setup problem, not a verdict on the file.
    """
    import torch  # lazily: the daemon must never pay for (or require) torch

    try:
        obj = torch.load(os.fspath(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # untrusted bytes: torch.load raises anything (UnpicklingError, RuntimeError,
        # EOFError, KeyError...), and each is a verdict on the file, never a crash of the validator
        return ZipCheck("unreadable", f"torch.load failed: {type(exc).__name__}: {exc}")
    kind = type(obj).__name__
    del obj
    return ZipCheck("ok", f"torch.load ok ({kind})")


def _layout(fd: int, size: int) -> tuple[list[_Record], list[tuple[int, int]]]:
    """The records of a torch.save zip of `size` bytes and their data ranges; raises _BadFileError."""
    records, cd_offset = _read_central_directory(fd, size)
    _require_torch_layout(records)
    return records, _locate_records(fd, records, cd_offset, size)


def _classify_non_zip(head: bytes) -> ZipCheck:
    if head[:1] == b"\x80" and _LEGACY_MAGIC in head[:32]:
        return ZipCheck(
            "legacy_pickle",
            "legacy torch.save format (_use_new_zipfile_serialization=False): it has no checksums, "
            "so it cannot be verified; re-save it with a current torch to make it verifiable",
        )
    if head.startswith(_SIG_EOCD):
        return ZipCheck("not_torch_zip", "empty zip archive")
    if head[:1] == b"\x80" and 2 <= head[1] <= 5:
        return ZipCheck("not_torch_zip", "a pickle stream, not a torch.save checkpoint")
    return ZipCheck("not_torch_zip", f"not a zip archive (starts with {head[:8].hex()})")


def _read_central_directory(fd: int, size: int) -> tuple[list[_Record], int]:
    """Parse the end records and the central directory; returns records and where the directory starts."""
    tail_len = min(size, _EOCD.size + _MAX_COMMENT)
    tail = os.pread(fd, tail_len, size - tail_len)
    # The end record is the last one whose comment reaches exactly to the end of the file.
    last = eocd_at = tail.rfind(_SIG_EOCD, 0, len(tail) - _EOCD.size + len(_SIG_EOCD))
    while eocd_at >= 0 and eocd_at + _EOCD.size + _comment_len(tail, eocd_at) != len(tail):
        eocd_at = tail.rfind(_SIG_EOCD, 0, eocd_at)
    if eocd_at < 0:
        if last >= 0 and last + _EOCD.size + _comment_len(tail, last) < len(tail):
            raise _BadFileError("unreadable", "unexpected bytes after the end-of-central-directory record")
        raise _BadFileError("truncated", f"no end-of-central-directory record: the file ends at byte {size}")
    eocd_pos = size - tail_len + eocd_at
    _, disk, cd_disk, _, entries, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, eocd_at)
    end_of_cd = eocd_pos
    locator_pos = eocd_pos - _ZIP64_LOCATOR.size
    if locator_pos >= 0 and os.pread(fd, 4, locator_pos) == _SIG_ZIP64_LOCATOR:
        _, _, z64_pos, _ = _ZIP64_LOCATOR.unpack(os.pread(fd, _ZIP64_LOCATOR.size, locator_pos))
        if z64_pos + _ZIP64_EOCD.size > locator_pos:
            raise _BadFileError("unreadable", "zip64 end record points past its locator")
        z64 = os.pread(fd, _ZIP64_EOCD.size, z64_pos)
        if z64[:4] != _SIG_ZIP64_EOCD:
            raise _BadFileError("unreadable", f"no zip64 end record at byte {z64_pos}")
        _, _, _, _, disk, cd_disk, _, entries, cd_size, cd_offset = _ZIP64_EOCD.unpack(z64)
        end_of_cd = z64_pos
    if disk or cd_disk:
        raise _BadFileError("not_torch_zip", "multi-volume zip archive")
    if cd_offset + cd_size > size:
        raise _BadFileError("truncated", f"central directory ends at byte {cd_offset + cd_size}, past the end ({size})")
    if entries * _CENTRAL.size > cd_size:
        raise _BadFileError("unreadable", f"end record claims {entries} entries in a {cd_size}-byte directory")
    if cd_offset + cd_size != end_of_cd:
        raise _BadFileError("unreadable", "central directory size or offset inconsistent with the end record")
    return _parse_central_directory(os.pread(fd, cd_size, cd_offset), entries), cd_offset


def _comment_len(tail: bytes, eocd_at: int) -> int:
    return int.from_bytes(tail[eocd_at + _EOCD.size - 2 : eocd_at + _EOCD.size], "little")


def _parse_central_directory(cd: bytes, entries: int) -> list[_Record]:
    records: list[_Record] = []
    pos = 0
    for index in range(entries):
        if pos + _CENTRAL.size > len(cd) or cd[pos : pos + 4] != _SIG_CENTRAL:
            raise _BadFileError("unreadable", f"central directory entry {index} is damaged")
        header = _CENTRAL.unpack_from(cd, pos)
        flags, method, crc, csize, usize, name_len, extra_len, comment_len = header[3:5] + header[7:13]
        offset = header[16]
        name_start = pos + _CENTRAL.size
        raw_name = cd[name_start : name_start + name_len]
        extra = cd[name_start + name_len : name_start + name_len + extra_len]
        pos = name_start + name_len + extra_len + comment_len
        if pos > len(cd):
            raise _BadFileError("unreadable", f"central directory entry {index} runs past the directory")
        name = raw_name.decode("utf-8" if flags & _FLAG_UTF8 else "cp437", errors="replace")
        if flags & _FLAG_ENCRYPTED:
            raise _BadFileError("not_torch_zip", f"record {name!r} is encrypted")
        usize, csize, offset = _apply_zip64_extra(extra, usize, csize, offset, name)
        records.append(_Record(name, method, crc, csize, usize, offset))
    if pos != len(cd):
        raise _BadFileError("unreadable", "central directory holds more than its entry count")
    return records


def _apply_zip64_extra(extra: bytes, usize: int, csize: int, offset: int, name: str) -> tuple[int, int, int]:
    """Replace the 0xFFFFFFFF placeholders by the 64-bit values of the zip64 extra field, in that order."""
    fields = [usize, csize, offset]
    missing = [i for i, value in enumerate(fields) if value == 0xFFFFFFFF]
    pos = 0
    while missing and pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        data = extra[pos + 4 : pos + 4 + length]
        pos += 4 + length
        if len(data) < length:  # a field that claims more bytes than the entry holds
            break
        if tag == 0x0001 and length >= 8 * len(missing):
            for i, (value,) in zip(missing, struct.iter_unpack("<Q", data[: 8 * len(missing)]), strict=True):
                fields[i] = value
            missing = []
    if missing:
        raise _BadFileError("unreadable", f"record {name!r} lacks its zip64 sizes")
    return fields[0], fields[1], fields[2]


def _require_torch_layout(records: Sequence[_Record]) -> None:
    """torch.save puts every record under one top-level folder, with the pickle in data.pkl."""
    if not records:
        raise _BadFileError("not_torch_zip", "zip archive without records")
    prefix = records[0].name.split("/", 1)[0] + "/"
    if not any(r.name == prefix + "data.pkl" for r in records):
        raise _BadFileError("not_torch_zip", f"zip archive without {prefix}data.pkl: not written by torch.save")
    for r in records:
        if r.method not in (_STORED, _DEFLATED):
            raise _BadFileError("not_torch_zip", f"record {r.name!r}: unsupported compression method {r.method}")


def _locate_records(fd: int, records: Sequence[_Record], cd_offset: int, size: int) -> list[tuple[int, int]]:
    """Read each local header; returns (data start, data end) per record, in `records` order."""
    ranges: list[tuple[int, int]] = [(0, 0)] * len(records)
    previous_end = 0
    for index in sorted(range(len(records)), key=lambda i: records[i].header_offset):
        r = records[index]
        where = f"local header of {r.name!r} at byte {r.header_offset}"
        if r.header_offset < previous_end:
            raise _BadFileError("unreadable", f"{where} overlaps the record before it")
        raw_name = r.name.encode("utf-8")
        header = os.pread(fd, _LOCAL.size + len(raw_name), r.header_offset)
        if len(header) < _LOCAL.size:
            raise _BadFileError("truncated", f"{where} is past the end of the file")
        sig, _, flags, method, _, _, crc, _, _, name_len, extra_len = _LOCAL.unpack_from(header)
        if sig != _SIG_LOCAL or method != r.method or header[_LOCAL.size :] != raw_name:
            raise _BadFileError("unreadable", f"{where} is damaged")
        # Without a trailing data descriptor (flag bit 3) the local header repeats the CRC.
        if not flags & 0x8 and crc != r.crc:
            raise _BadFileError("crc_mismatch", f"{where} and the central directory disagree on the CRC-32")
        if r.method == _STORED and r.compressed_size != r.size:
            raise _BadFileError("unreadable", f"stored record {r.name!r} has two different sizes")
        start = r.header_offset + _LOCAL.size + name_len + extra_len
        end = start + r.compressed_size
        if end > size:
            raise _BadFileError("truncated", f"record {r.name!r} ends at byte {end}, past the end ({size})")
        if end > cd_offset:
            raise _BadFileError("unreadable", f"record {r.name!r} overlaps the central directory")
        ranges[index] = (start, end)
        previous_end = end
    return ranges


def _verify_crcs(
    fd: int,
    records: Sequence[_Record],
    ranges: Sequence[tuple[int, int]],
    known: Mapping[tuple[int, int], int] | None = None,
) -> ZipCheck:
    """Checksum every record (a stored one's CRC may be `known`, by data range); report the first bad one
    in file order."""
    known = known or {}
    computed = [
        _inflate_crc(fd, r, start, end)
        if r.method != _STORED
        else known[start, end]
        if (start, end) in known
        else _stored_crc(fd, start, end)
        for r, (start, end) in zip(records, ranges, strict=True)
    ]
    bad = sorted((ranges[i][0], i) for i, r in enumerate(records) if computed[i] != r.crc)
    if bad:
        r = records[bad[0][1]]
        start, end = ranges[bad[0][1]]
        others = f" (and {len(bad) - 1} more records)" if len(bad) > 1 else ""
        return ZipCheck(
            "crc_mismatch",
            f"record {r.name!r} (bytes {start}-{end}): stored CRC-32 {r.crc:08x}, "
            f"computed {computed[bad[0][1]]:08x}{others}",
        )
    total = sum(end - start for start, end in ranges)
    return ZipCheck("ok", f"{len(records)} records, {total} bytes, all CRC-32 match")


def _stored_crc(fd: int, start: int, end: int) -> int:
    """CRC-32 of the bytes start..end, read with pread in pieces through one buffer."""
    buf = memoryview(bytearray(min(PIECE_BYTES, end - start)))
    crc = 0
    for offset in range(start, end, PIECE_BYTES):
        view = buf[: min(PIECE_BYTES, end - offset)]
        if os.preadv(fd, [view], offset) != len(view):
            raise _BadFileError("truncated", f"file shrank during verification (short read at byte {offset})")
        crc = crc32(view, crc)
    return crc


def _inflate_crc(fd: int, r: _Record, start: int, end: int) -> int:
    """CRC-32 of a deflated record's content, inflating in bounded steps (torch itself never deflates)."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    crc = produced = 0
    try:
        for offset in range(start, end, PIECE_BYTES):
            data = os.pread(fd, min(PIECE_BYTES, end - offset), offset)
            while data:
                out = inflater.decompress(data, PIECE_BYTES)
                crc = crc32(out, crc)
                produced += len(out)
                data = inflater.unconsumed_tail
        out = inflater.flush()
    except zlib.error as exc:
        raise _BadFileError("crc_mismatch", f"record {r.name!r}: corrupt deflate stream ({exc})") from None
    crc = crc32(out, crc)
    produced += len(out)
    if not inflater.eof or produced != r.size:
        raise _BadFileError("crc_mismatch", f"record {r.name!r}: inflates to {produced} bytes, expected {r.size}")
    return crc
