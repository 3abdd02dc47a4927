"""Format validators: fed the copy's own buffer, they tell a whole checkpoint from a torn or corrupt one."""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import pytest
import torch

from mirrord.core.branches import Recorded, branches
from mirrord.formats.validators import new_validator, safetensors_verdict, validate_fd
from mirrord.store.resume import validate_key
from mirrord.store.volume import LocalVolume


@pytest.fixture(scope="module")
def torch_bytes() -> bytes:
    torch.manual_seed(0)
    out = io.BytesIO()
    torch.save({"w": torch.randn(200_000), "b": torch.randn(7), "layers": [torch.randn(3000) for _ in range(4)]}, out)
    return out.getvalue()


def streamed(tmp_path: Path, name: str, data: bytes, chunk: int, planned: bool = False) -> str:
    """Feed `data` in chunks of `chunk` bytes (from a buffer with junk past n), as the copier does; with
    `planned`, the validator is given the file's descriptor up front, as the copier gives it (a torch
    zip's directory is then read before the first byte)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        validator = new_validator(name, fd if planned else None)
        for i in range(0, len(data), chunk):
            piece = data[i : i + chunk]
            validator.feed(bytearray(piece) + b"PK\x03\x04junk", len(piece))
        return validator.finish(fd).status
    finally:
        os.close(fd)


def whole_file(tmp_path: Path, name: str, data: bytes, quick: bool = False) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return validate_fd(fd, name, quick=quick).status
    finally:
        os.close(fd)


@pytest.mark.parametrize("planned", [False, True], ids=["read_back", "directory_first"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 4096, 1 << 20, 1 << 30])
def test_a_whole_torch_save_passes_whatever_the_chunk_boundaries(
    tmp_path: Path, torch_bytes: bytes, chunk: int, planned: bool
) -> None:
    """Records cut by a chunk boundary are checksummed all the same, whether their CRCs are computed on
    each record's range read from the directory first, or by reading the records back at the end."""
    if chunk < 64:  # byte-sized chunks on a small checkpoint: the same boundaries, fewer calls
        small = io.BytesIO()
        torch.save({"w": torch.randn(300), "b": torch.randn(2)}, small)
        data = small.getvalue()
    else:
        data = torch_bytes
    assert streamed(tmp_path, "step_1.pt", data, chunk, planned) == "ok"
    corrupt = bytearray(data)
    corrupt[-len(data) // 3] ^= 1
    assert streamed(tmp_path, "step_1.pt", bytes(corrupt), chunk, planned) in ("crc_mismatch", "unreadable")


@pytest.mark.parametrize("planned", [False, True], ids=["read_back", "directory_first"])
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.9999])
def test_a_truncated_torch_save_is_truncated(tmp_path: Path, torch_bytes: bytes, cut: float, planned: bool) -> None:
    data = torch_bytes[: int(len(torch_bytes) * cut)]
    assert streamed(tmp_path, "step_1.pt", data, 65536, planned) == "truncated"
    assert whole_file(tmp_path, "step_1.pt", data) == "truncated"
    assert whole_file(tmp_path, "step_1.pt", data, quick=True) == "truncated"


@pytest.mark.parametrize("planned", [False, True], ids=["read_back", "directory_first"])
def test_a_flipped_bit_in_tensor_data_is_a_crc_mismatch(tmp_path: Path, torch_bytes: bytes, planned: bool) -> None:
    data = bytearray(torch_bytes)
    data[len(data) // 2] ^= 0x10
    assert streamed(tmp_path, "step_1.pt", bytes(data), 65536, planned) == "crc_mismatch"
    assert whole_file(tmp_path, "step_1.pt", bytes(data)) == "crc_mismatch"
    assert whole_file(tmp_path, "step_1.pt", bytes(data), quick=True) == "ok"  # structure only


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_directory_that_moved_while_streaming_is_judged_by_reading_the_records_back(
    tmp_path: Path, torch_bytes: bytes, corrupt: bool
) -> None:
    """The directory read before streaming no longer matches the one at the end (the file was rewritten
    in place meanwhile): the CRCs computed on the planned ranges prove nothing, so the records of the
    file as it now is are read back and checksummed; the verdict is that file's."""
    torch.manual_seed(1)
    other = io.BytesIO()
    torch.save({"x": torch.randn(50_000)}, other)
    now = bytearray(torch_bytes)
    if corrupt:
        now[len(now) // 2] ^= 0x10
    path = tmp_path / "step_1.pt"
    path.write_bytes(other.getvalue())
    fd = os.open(path, os.O_RDWR)
    try:
        validator = new_validator("step_1.pt", fd)
        validator.feed(bytearray(other.getvalue()[:4096]), 4096)  # the directory of `other` is read here
        os.ftruncate(fd, 0)
        os.pwrite(fd, bytes(now), 0)
        validator.feed(bytearray(now[4096:]), len(now) - 4096)
        assert validator.finish(fd).status == ("crc_mismatch" if corrupt else "ok")
    finally:
        os.close(fd)


def test_an_empty_file_fails_whatever_its_name(tmp_path: Path) -> None:
    for name in ("step_1.pt", "x.safetensors", "x.json", "x.bin"):
        assert streamed(tmp_path, name, b"", 4096) == "empty"
        assert whole_file(tmp_path, name, b"") == "empty"


def test_formats_without_a_validator_are_unchecked_never_broken(tmp_path: Path) -> None:
    legacy = io.BytesIO()
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    assert streamed(tmp_path, "old.pt", legacy.getvalue(), 4096) == "unchecked"
    assert streamed(tmp_path, "weights.bin", os.urandom(10_000), 4096) == "unchecked"
    assert whole_file(tmp_path, "old.pt", legacy.getvalue()) == "unchecked"


def safetensors_bytes(tensors: dict[str, int], extra: int = 0) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n // 4], "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + os.urandom(at + extra)


def test_safetensors_offsets_must_cover_the_file_exactly(tmp_path: Path) -> None:
    good = safetensors_bytes({"a": 400, "b": 4000})
    assert streamed(tmp_path, "m.safetensors", good, 7) == "ok"
    assert whole_file(tmp_path, "m.safetensors", good) == "ok"
    assert streamed(tmp_path, "m.safetensors", good[:-1], 4096) == "truncated"
    assert streamed(tmp_path, "m.safetensors", safetensors_bytes({"a": 400}, extra=3), 4096) == "invalid"
    assert streamed(tmp_path, "m.safetensors", good[:20], 4096) == "truncated"
    assert safetensors_verdict(b"\x05\x00\x00\x00\x00\x00\x00\x00{not", 100).status == "invalid"


def test_json_must_parse(tmp_path: Path) -> None:
    assert streamed(tmp_path, "state.json", b'{"step": 3}', 2) == "ok"
    assert streamed(tmp_path, "state.json", b'{"step": ', 2) == "invalid"


def test_branches_order_steps_by_rollback_then_step() -> None:
    """Written 2, 4, 6 then (after a rollback) 3, 5: the new branch comes after the old one."""
    b = branches({2: 10, 4: 20, 6: 30, 3: 40, 5: 50})
    assert b.rollbacks == ((6, 3),)
    assert sorted([2, 3, 4, 5, 6], key=b.key) == [2, 4, 6, 3, 5]
    assert branches({1: 5, 2: 5, 3: 5}).rollbacks == ()  # equal (coarse) mtimes invent no rollback
    assert branches({1: 0, 2: 10, 3: 20}).rollbacks == ()  # an unknown mtime says nothing about order


def test_a_lower_step_recorded_before_the_higher_one_was_saved_is_no_rollback() -> None:
    """Step 3's mtime is the newest (a clock stepped back, a touch), but its bytes were recorded before step 4
    was saved (by the wall clock), or recorded first (by sequence) while the clock said later: no rollback. A
    lower step recorded after the higher one, by both, is one."""
    s = 1_000_000_000
    mtimes = {1: 10 * s, 2: 20 * s, 3: 90 * s, 4: 40 * s, 5: 50 * s}
    assert branches(mtimes).rollbacks == ((5, 3),)
    assert branches(mtimes, {3: Recorded(at_ns=35 * s)}).rollbacks == ()
    later = {4: Recorded(45 * s, 4), 5: Recorded(55 * s, 5)}
    assert branches(mtimes, {3: Recorded(95 * s, 3), **later}).rollbacks == ()  # the clock was ahead for step 3
    assert branches(mtimes, {3: Recorded(95 * s, 6), **later}).rollbacks == ((5, 3),)  # recorded after, by both
    assert branches(mtimes, {3: Recorded(95 * s, 3)}).rollbacks == ((5, 3),)  # 5's record unknown


def test_library_files_pass_by_name_streamed_and_whole(tmp_path: Path) -> None:
    """What safetensors, json and dcp.save write is judged by its own format (chosen by name), never as a
    torch zip: a .distcp starts with a zip but is many of them end to end."""
    from safetensors.torch import save_file

    from tests.support.folders import write_dcp

    save_file({"w": torch.randn(64, 8), "b": torch.zeros(8)}, tmp_path / "model.safetensors")
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    write_dcp(tmp_path / "step_4", 4)
    folder = tmp_path / "step_4"
    expected = {
        "model.safetensors": ("ok", "safetensors"),
        "trainer_state.json": ("ok", "json"),
        "step_4/.metadata": ("ok", "dcp"),
        "step_4/__0_0.distcp": ("unchecked", "dcp"),
    }
    for rel, (status, fmt) in expected.items():
        data = (tmp_path / rel).read_bytes()
        name, copy = rel.rsplit("/", 1)[-1], rel.replace("/", "_")
        assert streamed(tmp_path / "s" / copy, name, data, 4096) == status, rel
        assert whole_file(tmp_path / "w" / copy, name, data) == status, rel
        verdict = validate_key(LocalVolume(tmp_path), rel)
        assert (verdict.status, verdict.format) == ("ok", fmt), (rel, verdict)
    # with its folder, a truncated data file is caught by the range its .metadata gives it
    distcp = folder / "__0_0.distcp"
    os.truncate(distcp, distcp.stat().st_size - 10)
    assert validate_key(LocalVolume(tmp_path), "step_4/__0_0.distcp").status == "truncated"
    assert validate_key(LocalVolume(tmp_path), "step_4/.metadata").status == "truncated"


def test_json_nested_100000_deep_is_invalid_not_a_crash(tmp_path: Path) -> None:
    """json's parser recurses per level: a file nested past the interpreter's limit is a verdict, as is a
    safetensors header nested so."""
    deep = b"[" * 100_000 + b"]" * 100_000
    assert streamed(tmp_path, "trainer_state.json", deep, 4096) == "invalid"
    assert whole_file(tmp_path, "trainer_state.json", deep) == "invalid"
    header = b'{"a": ' + deep + b"}"
    assert safetensors_verdict(len(header).to_bytes(8, "little") + header, 8 + len(header)).status == "invalid"
