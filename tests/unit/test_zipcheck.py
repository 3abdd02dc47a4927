"""Deep verification of torch.save files: every kind of damage gets its own status, found without torch."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from mirrord.formats import zipcheck
from mirrord.formats.zipcheck import STATUSES, check_torch_zip, check_torch_zip_fd, load_check
from tests.support.checkpoints import checkpoint_state


def _checkpoint_bytes() -> bytes:
    """A small model and its Adam state after one step, as a trainer would save them."""
    buf = io.BytesIO()
    torch.save(checkpoint_state(1), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def checkpoint_bytes() -> bytes:
    return _checkpoint_bytes()


@pytest.fixture
def checkpoint(tmp_path: Path, checkpoint_bytes: bytes) -> Path:
    path = tmp_path / "step_00000001.pt"
    path.write_bytes(checkpoint_bytes)
    return path


def _data_range(path: Path, name: str) -> tuple[int, int]:
    """Byte range of a record's content, from its local header (the range a flipped byte must land in)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.compress_size


def _largest_tensor_record(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        tensors = [i for i in zf.infolist() if "/data/" in i.filename]
    return max(tensors, key=lambda i: i.file_size).filename


def _flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_intact_checkpoint_is_ok(checkpoint: Path) -> None:
    """A fresh torch.save file passes, and the verdict says how much was checked."""
    result = check_torch_zip(checkpoint)
    assert result.status == "ok", result.detail
    assert result.ok
    assert "records" in result.detail


def test_accepts_str_path(checkpoint: Path) -> None:
    """Paths may be given as str as well as pathlib.Path."""
    assert check_torch_zip(str(checkpoint)).ok


@pytest.mark.parametrize("percent", [25, 50, 73, 99])
def test_truncated_checkpoint_is_truncated(checkpoint: Path, percent: int) -> None:
    """A file cut short (a write or copy interrupted) is reported as truncated, whatever the cut point."""
    raw = checkpoint.read_bytes()
    checkpoint.write_bytes(raw[: len(raw) * percent // 100])
    result = check_torch_zip(checkpoint)
    assert result.status == "truncated", result.detail


def test_last_byte_missing_is_truncated(checkpoint: Path) -> None:
    """Even one missing byte at the end is caught (the end record must reach the end of the file)."""
    checkpoint.write_bytes(checkpoint.read_bytes()[:-1])
    assert check_torch_zip(checkpoint).status == "truncated"


def test_zeroed_tail_is_truncated(checkpoint: Path) -> None:
    """A crash can leave the right size but zeros at the end (delayed allocation): still truncated."""
    raw = bytearray(checkpoint.read_bytes())
    cut = len(raw) * 9 // 10
    raw[cut:] = bytes(len(raw) - cut)
    checkpoint.write_bytes(bytes(raw))
    assert check_torch_zip(checkpoint).status == "truncated"


def test_empty_file_is_truncated(tmp_path: Path) -> None:
    """A zero-length file is what a writer that died right after open() leaves behind."""
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    assert check_torch_zip(path).status == "truncated"


def test_flipped_byte_in_tensor_is_crc_mismatch_naming_the_record(checkpoint: Path) -> None:
    """One flipped bit-pattern in the middle of a tensor: crc_mismatch, naming that record."""
    name = _largest_tensor_record(checkpoint)
    start, end = _data_range(checkpoint, name)
    _flip_byte(checkpoint, (start + end) // 2)
    result = check_torch_zip(checkpoint)
    assert result.status == "crc_mismatch", result.detail
    assert repr(name) in result.detail


def test_flipped_byte_in_middle_of_file_is_crc_mismatch(checkpoint: Path) -> None:
    """The middle byte of the file lies inside a record: its damage is caught."""
    size = checkpoint.stat().st_size
    _flip_byte(checkpoint, size // 2)
    assert check_torch_zip(checkpoint).status == "crc_mismatch"


def test_flipped_byte_in_pickle_is_crc_mismatch(checkpoint: Path) -> None:
    """The pickle that describes the checkpoint is protected like the tensors."""
    with zipfile.ZipFile(checkpoint) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
    start, end = _data_range(checkpoint, pkl)
    _flip_byte(checkpoint, (start + end) // 2)
    result = check_torch_zip(checkpoint)
    assert result.status == "crc_mismatch"
    assert repr(pkl) in result.detail


def test_zeroed_block_inside_a_tensor_is_crc_mismatch(checkpoint: Path) -> None:
    """A block of zeros where tensor data was (a lost write) is caught."""
    start, _end = _data_range(checkpoint, _largest_tensor_record(checkpoint))
    raw = bytearray(checkpoint.read_bytes())
    raw[start : start + 512] = bytes(512)
    checkpoint.write_bytes(bytes(raw))
    assert check_torch_zip(checkpoint).status == "crc_mismatch"


def test_damaged_local_header_is_unreadable(checkpoint: Path) -> None:
    """A record that cannot be located (its header signature is gone) is unreadable, not ok."""
    with zipfile.ZipFile(checkpoint) as zf:
        offset = zf.infolist()[3].header_offset
    _flip_byte(checkpoint, offset)
    assert check_torch_zip(checkpoint).status == "unreadable"


def test_trailing_garbage_is_unreadable(checkpoint: Path) -> None:
    """Bytes after the end record mean the file is not what torch.save wrote."""
    with checkpoint.open("ab") as f:
        f.write(b"\x00" * 100)
    assert check_torch_zip(checkpoint).status == "unreadable"


def test_legacy_format_is_reported_as_legacy(tmp_path: Path) -> None:
    """The pre-zip format has no checksums: it is named as such, never passed as ok."""
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(8)}, path, _use_new_zipfile_serialization=False)
    result = check_torch_zip(path)
    assert result.status == "legacy_pickle"
    assert "_use_new_zipfile_serialization" in result.detail


def test_legacy_format_with_newer_pickle_protocol(tmp_path: Path) -> None:
    """Legacy files saved with pickle protocol 4 (framed) are recognised too."""
    path = tmp_path / "legacy4.pt"
    torch.save({"w": torch.ones(8)}, path, _use_new_zipfile_serialization=False, pickle_protocol=4)
    assert check_torch_zip(path).status == "legacy_pickle"


def test_plain_pickle_is_not_torch_zip(tmp_path: Path) -> None:
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps({"step": 3}, protocol=4))
    result = check_torch_zip(path)
    assert result.status == "not_torch_zip"
    assert "pickle" in result.detail


def test_text_file_is_not_torch_zip(tmp_path: Path) -> None:
    path = tmp_path / "notes.pt"
    path.write_text("not a checkpoint\n")
    assert check_torch_zip(path).status == "not_torch_zip"


def test_zip_without_data_pkl_is_not_torch_zip(tmp_path: Path) -> None:
    """A healthy zip that torch.save did not write is not passed off as a checkpoint."""
    path = tmp_path / "other.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/readme.txt", "hello")
    result = check_torch_zip(path)
    assert result.status == "not_torch_zip"
    assert "data.pkl" in result.detail


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    result = check_torch_zip(tmp_path / "absent.pt")
    assert result.status == "unreadable"


def test_directory_is_unreadable(tmp_path: Path) -> None:
    assert check_torch_zip(tmp_path).status == "unreadable"


def test_fifo_is_unreadable_without_blocking(tmp_path: Path) -> None:
    """A FIFO named like a checkpoint is reported at once, not waited on for a writer."""
    fifo = tmp_path / "step_00000001.pt"
    os.mkfifo(fifo)
    result = check_torch_zip(fifo)
    assert result.status == "unreadable"
    assert "regular file" in result.detail


def test_check_on_an_open_fd_leaves_it_open_and_unmoved(checkpoint: Path) -> None:
    """Callers that opened the file safely can check that very file; its offset is not disturbed."""
    fd = os.open(checkpoint, os.O_RDONLY)
    try:
        os.lseek(fd, 7, os.SEEK_SET)
        assert check_torch_zip_fd(fd).ok
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7
    finally:
        os.close(fd)


def test_deflated_records_are_verified(tmp_path: Path, checkpoint: Path) -> None:
    """Re-zipped with deflate (torch never does, other tools may): still verified, damage still found."""
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(checkpoint) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert check_torch_zip(path).status == "ok"
    start, end = _data_range(path, _largest_tensor_record(path))
    _flip_byte(path, (start + end) // 2)
    assert check_torch_zip(path).status == "crc_mismatch"


def _zip64_archive(records: dict[str, bytes]) -> bytes:
    """A stored zip whose central directory keeps every size and offset in zip64 extra fields.

    torch only writes those for files over 4 GiB; building one by hand keeps the test small.
    """
    out = bytearray()
    central = bytearray()
    for name, data in records.items():
        offset = len(out)
        raw = name.encode()
        crc = zlib.crc32(data)
        out += struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 45, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0)
        out += raw + data
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset)
        central += struct.pack(
            "<4sHHHHHHLLLHHHHHLL",
            b"PK\x01\x02",
            45,
            45,
            0,
            0,
            0,
            0,
            crc,
            0xFFFFFFFF,
            0xFFFFFFFF,
            len(raw),
            len(extra),
            0,
            0,
            0,
            0,
            0xFFFFFFFF,
        )
        central += raw + extra
    cd_offset = len(out)
    out += central
    z64_offset = len(out)
    n = len(records)
    out += struct.pack("<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(central), cd_offset)
    out += struct.pack("<4sLQL", b"PK\x06\x07", 0, z64_offset, 1)
    out += struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return bytes(out)


def test_zip64_central_directory_is_understood(tmp_path: Path) -> None:
    """Sizes and offsets held in zip64 extra fields (checkpoints over 4 GiB) are read correctly."""
    path = tmp_path / "big.pt"
    records = {"archive/data.pkl": pickle.dumps({"w": 1}), "archive/data/0": bytes(range(256)) * 40}
    raw = _zip64_archive(records)
    path.write_bytes(raw)
    with zipfile.ZipFile(path) as zf:  # the hand-made archive is valid for the standard library too
        assert zf.testzip() is None
    assert check_torch_zip(path).status == "ok"
    flipped = bytearray(raw)
    flipped[raw.index(records["archive/data/0"]) + 5000] ^= 1
    path.write_bytes(bytes(flipped))
    result = check_torch_zip(path)
    assert result.status == "crc_mismatch"
    assert "'archive/data/0'" in result.detail


def test_a_zip64_field_longer_than_its_entry_is_unreadable_not_a_crash(tmp_path: Path) -> None:
    """A zip64 extra field that claims more bytes than the directory entry holds is a damaged directory."""
    path = tmp_path / "big.pt"
    raw = _zip64_archive({"archive/data.pkl": pickle.dumps({"w": 1})})
    field = struct.pack("<HH", 1, 24)
    path.write_bytes(raw.replace(field, struct.pack("<HH", 1, 240)))
    result = check_torch_zip(path)
    assert result.status == "unreadable"
    assert "zip64" in result.detail


def test_records_longer_than_a_piece_verify(monkeypatch: pytest.MonkeyPatch, checkpoint: Path) -> None:
    """Records longer than a piece are checksummed piece by piece into one CRC."""
    monkeypatch.setattr(zipcheck, "PIECE_BYTES", 1000)
    assert check_torch_zip(checkpoint).status == "ok"
    _start, end = _data_range(checkpoint, _largest_tensor_record(checkpoint))
    _flip_byte(checkpoint, end - 1)
    assert check_torch_zip(checkpoint).status == "crc_mismatch"


def test_statuses_are_the_documented_set() -> None:
    assert set(STATUSES) == {
        "ok",
        "truncated",
        "crc_mismatch",
        "not_torch_zip",
        "legacy_pickle",
        "unreadable",
    }


class _NotAllowed:
    """A class weights_only loading refuses to build."""


def test_load_check_loads_a_good_checkpoint(checkpoint: Path) -> None:
    result = load_check(checkpoint)
    assert result.status == "ok", result.detail


def test_load_check_refuses_arbitrary_objects(tmp_path: Path) -> None:
    """weights_only=True: a checkpoint that needs arbitrary code to load is not reported as loadable."""
    path = tmp_path / "custom.pt"
    torch.save({"thing": _NotAllowed()}, path)
    assert check_torch_zip(path).status == "ok"
    result = load_check(path)
    assert result.status == "unreadable"
    assert "torch.load failed" in result.detail
