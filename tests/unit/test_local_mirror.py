"""What the filesystem implementation of the seam promises beyond the contract: no symlink is followed,
no FIFO blocks a reader, a folder unit exists under its final name only whole, leftovers of a dead
writer are replaced. (The contract itself: tests/unit/test_mirror_contract.py.)"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from mirrord.layouts import layout_for
from mirrord.store.mirror import Upload
from mirrord.store.volume import LocalMirror, LocalVolume

PATTERNS = ("*.pt", "*.safetensors", "*.json")


def _put(upload: Upload, data: bytes) -> None:
    upload.write(memoryview(data))
    upload.seal(time.time_ns())
    upload.commit()


def test_describe_is_the_path(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path)
    assert mirror.describe() == str(tmp_path)
    assert mirror.describe("run/step_1.pt") == str(tmp_path / "run" / "step_1.pt")


def test_open_read_never_follows_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "step_1.pt").write_bytes(b"secret")
    root = tmp_path / "mirror"
    root.mkdir()
    (root / "link_step_1.pt").symlink_to(tmp_path / "outside" / "step_1.pt")
    (root / "run").symlink_to(tmp_path / "outside")
    volume = LocalVolume(root)
    with pytest.raises(OSError) as caught:
        volume.open_read("link_step_1.pt")
    assert caught.value.errno == errno.ELOOP
    with pytest.raises(OSError) as caught:
        volume.open_read("run/step_1.pt")
    assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)


def test_open_read_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "step_1.pt")
    with pytest.raises(OSError) as caught:
        LocalVolume(tmp_path).open_read("step_1.pt")  # a blocking open would wait here forever
    assert caught.value.errno == errno.EINVAL


def test_a_staged_unit_has_no_final_name_until_commit(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        staging = mirror.begin_unit("run/checkpoint-50")
        _put(staging.upload("model.safetensors", 7), b"weights")
        _put(staging.upload("trainer_state.json", 2), b"{}")
        assert [p.name for p in (tmp_path / "mirror" / "run").iterdir()] == []  # nothing a picker could take
        staged = tmp_path / "mirror" / staging.staging_key
        assert staged.parent.name == ".mirrord-staging" and (staged / "model.safetensors").is_file()
        assert mirror.stat("run/checkpoint-50/model.safetensors") is None
        snap = mirror.snapshot(PATTERNS, layout_for("hf"))
        assert not snap.files and not snap.staging  # the hidden area is not listed
        staging.commit()
        assert sorted(p.name for p in (tmp_path / "mirror" / "run" / "checkpoint-50").iterdir()) == [
            "model.safetensors",
            "trainer_state.json",
        ]
        assert list((tmp_path / "mirror" / ".mirrord-staging").iterdir()) == []


def test_trainer_pickers_never_see_a_unit_in_flight(tmp_path: Path) -> None:
    """HF's get_last_checkpoint and accelerate's "highest number in checkpoints/" pick among what a
    listing of the run folder shows: mid-copy, that is only whole units."""
    from transformers.trainer_utils import get_last_checkpoint

    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        for step, commit in ((10, True), (20, False)):
            staging = mirror.begin_unit(f"run/checkpoint-{step}")
            _put(staging.upload("model.safetensors", 7), b"weights")
            if commit:
                staging.commit()
        run = tmp_path / "mirror" / "run"
        assert get_last_checkpoint(str(run)) == str(run / "checkpoint-10")
        assert [p.name for p in run.iterdir()] == ["checkpoint-10"]  # accelerate sorts this listing by number
        staging.commit()
        assert get_last_checkpoint(str(run)) == str(run / "checkpoint-20")


def test_lightnings_last_picker_never_sees_a_file_in_flight(tmp_path: Path) -> None:
    """`fit(ckpt_path="last")` resolves through the Trainer's own connector: every `last*.ckpt` in the
    ModelCheckpoint's dirpath, newest mtime wins. Mid-copy of a newer `last.ckpt` (and of a new step),
    it picks the previous whole one."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    run = tmp_path / "mirror" / "run"
    mirror = LocalMirror(tmp_path / "mirror")
    trainer = Trainer(
        callbacks=[ModelCheckpoint(dirpath=run, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )

    def picked() -> str | None:
        path = trainer._checkpoint_connector._parse_ckpt_path(
            TrainerFn.FITTING, "last", model_provided=True, model_connected=True
        )
        return None if path is None else os.path.relpath(path, run)

    with mirror.lock():
        _put(mirror.begin_upload("run/last-v1.ckpt", 5), b"whole")
        assert picked() == "last-v1.ckpt"
        in_flight = [mirror.begin_upload(f"run/{name}", 5) for name in ("last.ckpt", "epoch=1-step=20.ckpt")]
        for upload in in_flight:
            upload.write(memoryview(b"torn"))
        assert picked() == "last-v1.ckpt"  # never the newer `last.ckpt` being written
        for upload in in_flight:
            upload.write(memoryview(b"!"))
            upload.seal(time.time_ns())
            upload.commit()
        assert picked() == "last.ckpt"


def test_the_staging_area_is_swept_when_the_mirror_is_locked_again(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        staging = mirror.begin_unit("run/checkpoint-30")
        _put(staging.upload("model.safetensors", 4), b"torn")
        left = tmp_path / "mirror" / staging.staging_key  # the writer dies here: no commit, no abort
    assert left.is_dir()
    with mirror.lock():
        assert not left.exists()


def test_a_retired_unit_leaves_the_run_folder_in_one_step(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        staging = mirror.begin_unit("run/checkpoint-40")
        _put(staging.upload("model.safetensors", 5), b"whole")
        staging.commit()
        mirror.delete_unit("run/checkpoint-40")
        assert list((tmp_path / "mirror" / "run").iterdir()) == []
        assert list((tmp_path / "mirror" / ".mirrord-staging").iterdir()) == []


def test_a_dead_staging_folder_is_replaced(tmp_path: Path) -> None:
    dead = tmp_path / "mirror" / "checkpoint-60.part"
    dead.mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"torn")
    (dead / "sub").mkdir()
    (dead / "sub" / "x.json").write_bytes(b"{")
    (dead / "escape").symlink_to(tmp_path)  # removed as a link, never followed
    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        staging = mirror.begin_unit("checkpoint-60")
        _put(staging.upload("model.safetensors", 5), b"whole")
        staging.commit()
    assert [p.name for p in (tmp_path / "mirror" / "checkpoint-60").iterdir()] == ["model.safetensors"]
    assert (tmp_path / "mirror" / "checkpoint-60" / "model.safetensors").read_bytes() == b"whole"
    assert tmp_path.is_dir() and (tmp_path / "mirror").is_dir()


def test_abort_spares_a_newer_staging_of_the_same_unit(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        old = mirror.begin_unit("checkpoint-70")
        new = mirror.begin_unit("checkpoint-70")  # the retry replaced the stalled one's folder
        old.abort()  # the stalled copy waking up late
        _put(new.upload("model.safetensors", 3), b"new")
        new.commit()
    assert (tmp_path / "mirror" / "checkpoint-70" / "model.safetensors").read_bytes() == b"new"


def test_an_abandoned_upload_waking_after_its_retry_published_touches_neither_the_file_nor_a_new_temp(
    tmp_path: Path,
) -> None:
    """A stalled copy is abandoned alive: its retry replaces its NAME.part and publishes, the next version's
    copy has its own NAME.part under way. The abandoned one wakes and commits: refused, and its cleanup
    removes neither the retry's file nor the new copy's temp file."""
    mirror = LocalMirror(tmp_path / "mirror")
    final = tmp_path / "mirror" / "run" / "step_1.pt"
    with mirror.lock():
        stalled = mirror.begin_upload("run/step_1.pt", 5)
        stalled.write(memoryview(b"stale"))
        _put(mirror.begin_upload("run/step_1.pt", 5), b"retry")
        newer = mirror.begin_upload("run/step_1.pt", 5)
        newer.write(memoryview(b"newer"))
        stalled.seal(time.time_ns())
        with pytest.raises(FileExistsError):
            stalled.commit()
        stalled.abort()
        assert final.read_bytes() == b"retry" and final.with_name("step_1.pt.part").read_bytes() == b"newer"
        newer.seal(time.time_ns())
        newer.commit()
    assert final.read_bytes() == b"newer" and sorted(p.name for p in final.parent.iterdir()) == ["step_1.pt"]


def test_writes_are_refused_once_the_mirror_is_not_the_pinned_volume(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path / "mirror")
    with mirror.lock():
        (tmp_path / "mirror" / ".mirrord-volume-id").write_text("mirrord-volume someone-else\n")
        assert mirror.identity_problem() is not None
        with pytest.raises(Exception, match="volume id"):
            mirror.begin_upload("step_1.pt", 1)
        with pytest.raises(Exception, match="volume id"):
            mirror.begin_unit("checkpoint-1")


def _unit(mirror: LocalMirror, key: str, files: dict[str, bytes]) -> None:
    staging = mirror.begin_unit(key)
    for rel, data in files.items():
        _put(staging.upload(rel, len(data)), data)
    staging.commit()


def _whole(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_a_changed_unit_is_staged_then_swapped_then_the_old_copy_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """Re-publishing checkpoint-50/ with other files: the new folder takes the name whole (exchanged in
    one step, or, where the filesystem cannot exchange names, after the old one is renamed aside), the
    old copy (now under a temp name) is removed, and nothing of it is merged into the new one."""
    from mirrord.store import atomic

    calls: list[bool] = []
    real = atomic.exchange

    def exchanging(dir_fd: int, a: str, b: str, b_dir_fd: int | None = None) -> bool:
        calls.append(exchange)
        return real(dir_fd, a, b, b_dir_fd) if exchange else False  # False: a filesystem refusing the exchange

    monkeypatch.setattr(atomic, "exchange", exchanging)
    root = tmp_path / "mirror"
    mirror = LocalMirror(root)
    with mirror.lock():
        _unit(mirror, "run/checkpoint-50", {"model.safetensors": b"old weights", "sub/optimizer.pt": b"old optim"})
        old_ino = (root / "run" / "checkpoint-50").stat().st_ino
        _unit(mirror, "run/checkpoint-50", {"model.safetensors": b"new", "trainer_state.json": b"{}"})
    assert calls == [exchange]
    assert _whole(root / "run" / "checkpoint-50") == {"model.safetensors": b"new", "trainer_state.json": b"{}"}
    assert (root / "run" / "checkpoint-50").stat().st_ino != old_ino
    assert sorted(p.name for p in (root / "run").iterdir()) == ["checkpoint-50"]  # no NAME.part/, NAME.old.part/
    assert list((root / ".mirrord-staging").iterdir()) == []  # the old copy was removed there


def test_an_old_copy_set_aside_is_a_staging_name_the_sweep_knows() -> None:
    """A NAME.old.part/ left by a process killed between the two renames is swept like NAME.part/."""
    for name in ("hf", "dcp", "deepspeed"):
        layout = layout_for(name)
        unit = {"hf": "checkpoint-50", "dcp": "step_8", "deepspeed": "global_step100"}[name]
        assert layout.is_staging_name(unit + ".part") and layout.is_staging_name(unit + ".old.part")
        assert not layout.is_staging_name(unit) and not layout.is_unit_name(unit + ".old.part")
    custom = layout_for("custom", patterns=("*_final",), unit="folder")
    assert custom.is_staging_name("run_final.old.part") and custom.is_staging_name("run_final.part")
