"""DCP folders: what `dcp.save` wrote, judged from its .metadata without torch and without unpickling."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp_torch

from mirrord.formats import dcpmeta
from mirrord.store.resume import dcp_check
from mirrord.store.volume import LocalVolume


def dcp_save(folder: Path, seed: int = 0) -> Path:
    """A real single-process dcp.save of a small model and its Adam state (no process group)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 32)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp_torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=folder)
    return folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return dcp_save(tmp_path / "step_4")


def data_file(folder: Path) -> Path:
    return next(p for p in folder.iterdir() if p.name.endswith(dcpmeta.DATA_SUFFIX))


def test_a_whole_dcp_save_is_ok_and_its_ranges_end_at_the_data_files_end(folder: Path, tmp_path: Path) -> None:
    """The references read without unpickling are torch's own, item by item, and end at the file's end."""
    meta = (folder / ".metadata").read_bytes()
    needed = dcpmeta.storage_references(meta)
    trusted = pickle.loads(meta)  # noqa: S301 (our own file, written just now)
    expected: dict[str, int] = {}
    for info in trusted.storage_data.values():
        expected[info.relative_path] = max(expected.get(info.relative_path, 0), info.offset + info.length)
    assert needed == expected == {data_file(folder).name: data_file(folder).stat().st_size}
    assert dcp_check(LocalVolume(tmp_path), "step_4/.metadata")[0] == "ok"
    assert dcp_check(LocalVolume(tmp_path), f"step_4/{data_file(folder).name}", data_file(folder).stat().st_size) == (
        "ok",
        f"{data_file(folder).stat().st_size} bytes, as .metadata says",
    )


def test_a_truncated_or_missing_data_file_makes_the_folder_truncated(folder: Path, tmp_path: Path) -> None:
    data = data_file(folder)
    size = data.stat().st_size
    os.truncate(data, size - 1)
    assert dcp_check(LocalVolume(tmp_path), "step_4/.metadata") == (
        "truncated",
        f"{data.name} holds {size - 1} bytes; .metadata places data up to byte {size}",
    )
    assert dcp_check(LocalVolume(tmp_path), f"step_4/{data.name}", size - 1)[0] == "truncated"
    data.unlink()
    assert dcp_check(LocalVolume(tmp_path), "step_4/.metadata") == (
        "truncated",
        f"{data.name} is referenced by .metadata but missing",
    )


def test_without_metadata_the_save_did_not_finish(folder: Path, tmp_path: Path) -> None:
    """dcp.save writes .metadata last: a folder without it is a save cut short, and so is each data file."""
    (folder / ".metadata").unlink()
    status, detail = dcp_check(LocalVolume(tmp_path), "step_4/.metadata")
    assert status == "truncated" and "did not finish" in detail
    assert dcp_check(LocalVolume(tmp_path), "step_4/__0_0.distcp", 1)[0] == "truncated"


def test_a_symlinked_metadata_or_data_file_is_not_followed(folder: Path, tmp_path: Path) -> None:
    data = data_file(folder)
    data.rename(tmp_path / "data")
    data.symlink_to(tmp_path / "data")
    assert dcp_check(LocalVolume(tmp_path), "step_4/.metadata")[1].endswith("missing")
    (folder / ".metadata").rename(tmp_path / "meta")
    (folder / ".metadata").symlink_to(tmp_path / "meta")
    assert dcp_check(LocalVolume(tmp_path), "step_4/.metadata")[0] == "unreadable"


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99])
def test_a_torn_metadata_is_invalid(folder: Path, cut: float) -> None:
    data = (folder / ".metadata").read_bytes()
    with pytest.raises(dcpmeta.MetadataError) as caught:
        dcpmeta.storage_references(data[: int(len(data) * cut)])
    assert caught.value.status == "invalid"


def test_a_pickle_of_something_else_is_invalid() -> None:
    with pytest.raises(dcpmeta.MetadataError, match=r"not a torch\.distributed\.checkpoint Metadata") as caught:
        dcpmeta.storage_references(pickle.dumps({"storage_data": {}}))
    assert caught.value.status == "invalid"


@pytest.mark.parametrize("bad", ["../outside.distcp", "/abs.distcp", "a/./b", ""])
def test_a_reference_outside_the_folder_is_invalid(folder: Path, bad: str) -> None:
    trusted = pickle.loads((folder / ".metadata").read_bytes())  # noqa: S301 (our own file)
    next(iter(trusted.storage_data.values())).relative_path = bad
    with pytest.raises(dcpmeta.MetadataError, match=r"unsafe path|lacks"):
        dcpmeta.storage_references(pickle.dumps(trusted))


def test_judge_is_pure_over_sizes() -> None:
    needed = {"a": 15, "b": 3}
    assert dcpmeta.judge(needed, {"a": 15, "b": 3})[0] == "ok"
    assert dcpmeta.judge(needed, {"a": 20, "b": 3})[0] == "ok"  # longer is not torn
    assert dcpmeta.judge(needed, {"a": 14, "b": 3})[0] == "truncated"
    assert dcpmeta.judge(needed, {"a": 15, "b": None})[0] == "truncated"
