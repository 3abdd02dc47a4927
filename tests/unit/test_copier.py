"""The copy protocol under real faults: after every one, no final name differs from its source, no .part
is left, and the error names the path and the cause.

Faults are injected on the real copy path: LocalUpload.write (the one place bytes reach the mirror) is
wrapped at the class level, os.fsync / os.replace are wrapped for .part files only, permission faults
come from a child that dropped root, and free-space faults from a real 8 MiB tmpfs.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mirrord.commands.sync import run_sync
from mirrord.config import Config
from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.errors import (
    CancelledError,
    MirrordError,
    NoSpaceError,
    PermanentError,
    SizeMismatchError,
    SourceChangedError,
    SourceGoneError,
    StalledError,
    TransientError,
)
from mirrord.obs.metrics import Metrics
from mirrord.service.copier import CopyControl, CopyOptions, copy_file
from mirrord.service.engine import Engine
from mirrord.service.workers import copy_all
from mirrord.store.manifest import Manifest
from mirrord.store.resume import latest_checkpoint
from mirrord.store.volume import LocalMirror, LocalUpload
from tests.support.checkpoints import publish_checkpoint, save_checkpoint
from tests.support.gate import FuseMount
from tests.support.mirror import assert_mirror_consistent, hash_file, mirror_files, names, sha256, temp_files
from tests.support.privileges import run_as_nobody
from tests.support.wait import wait_for

CHUNK = 64 * 1024
MiB = 1024 * 1024
OPTS = CopyOptions(algo="blake3", buffer_bytes=CHUNK, reserve_bytes=0)
REL = "run1/step_0010.pt"


@pytest.fixture
def source(primary: Path) -> Path:
    """A real ~1.6 MB checkpoint: about 25 chunks, so a fault can land at the start, middle or end."""
    return save_checkpoint(primary / REL, 10, width=256)


def copy(
    primary: Path, mirror: Path, rel: str = REL, options: CopyOptions = OPTS, control: CopyControl | None = None
) -> CopyResult:
    return copy_file(primary, rel, LocalMirror(mirror), options, control)


def assert_no_trace(mirror: Path, rel: str = REL) -> None:
    """Neither the final name nor any .part exists for the failed copy."""
    assert not (mirror / rel).exists(), f"{rel} was published by a failed copy"
    assert temp_files(mirror) == [], f"temp files left behind: {temp_files(mirror)}"


def assert_names(exc: MirrordError, rel: str = REL) -> None:
    assert exc.path.endswith(rel) and rel in str(exc), f"error does not name {rel}: {exc}"
    assert exc.cause and exc.cause in str(exc)


def hook_writes(monkeypatch: pytest.MonkeyPatch, after: Callable[[LocalUpload], None]) -> list[int]:
    """Call after(upload) once each chunk has reached the .part; returns the list of bytes written so far."""
    real = LocalUpload.write
    seen: list[int] = []

    def write(self: LocalUpload, data: memoryview) -> None:
        real(self, data)
        seen.append(self.written)
        after(self)

    monkeypatch.setattr(LocalUpload, "write", write)
    return seen


def once(action: Callable[[], None]) -> Callable[[LocalUpload], None]:
    done: list[bool] = []

    def hook(_upload: LocalUpload) -> None:
        if not done:
            done.append(True)
            action()

    return hook


# --- the happy path ---------------------------------------------------------------------------------------


def test_copy_is_identical_keeps_the_mtime_and_reports_the_digest(primary: Path, mirror: Path, source: Path) -> None:
    result = copy(primary, mirror)
    target = mirror / REL
    assert sha256(target) == sha256(source)
    assert target.stat().st_mtime_ns == source.stat().st_mtime_ns
    assert (result.rel, result.size, result.source_mtime_ns) == (REL, source.stat().st_size, source.stat().st_mtime_ns)
    assert result.digest == hash_file(target, "blake3") and result.algo == "blake3"
    assert temp_files(mirror) == []


def test_copied_checkpoint_loads_in_torch(primary: Path, mirror: Path, source: Path) -> None:
    import torch

    copy(primary, mirror)
    state = torch.load(mirror / REL, weights_only=True)
    assert state["step"] == 10 and state["optimizer"]["state"]


# --- write faults: EIO and ENOSPC after k bytes -----------------------------------------------------------


@pytest.mark.parametrize("where", ["first_byte", "mid_chunk", "last_byte"])
@pytest.mark.parametrize(("err", "error_type"), [(errno.EIO, TransientError), (errno.ENOSPC, NoSpaceError)])
def test_write_error_after_k_bytes(
    primary: Path,
    mirror: Path,
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
    err: int,
    error_type: type[MirrordError],
    where: str,
) -> None:
    """The mirror returns EIO / ENOSPC part-way; the .part goes, nothing is published; a retry rebuilds it."""
    size = source.stat().st_size
    limit = {"first_byte": 0, "mid_chunk": 5 * CHUNK + 1234, "last_byte": size - 1}[where]
    real = LocalUpload.write
    reached: list[int] = []

    def write(self: LocalUpload, data: memoryview) -> None:
        room = limit - self.written
        if room < len(data):
            if room > 0:
                real(self, data[:room])
            reached.append(self.written)
            raise OSError(err, os.strerror(err))
        real(self, data)

    monkeypatch.setattr(LocalUpload, "write", write)
    with pytest.raises(error_type) as info:
        copy(primary, mirror)
    assert type(info.value) is error_type and info.value.transient
    assert reached == [limit]
    assert_names(info.value)
    assert info.value.path == str(mirror / REL)
    assert os.strerror(err) in info.value.cause
    assert_no_trace(mirror)
    monkeypatch.undo()
    copy(primary, mirror)
    assert_mirror_consistent(primary, mirror)


def test_failed_recopy_leaves_the_previous_copy_untouched(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-copying a rewritten source fails half-way: the mirror keeps the old complete file, not a prefix."""
    copy(primary, mirror)
    old = sha256(mirror / REL)
    save_checkpoint(source, 11, width=256)

    def fail(upload: LocalUpload) -> None:
        if upload.written >= 3 * CHUNK:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    hook_writes(monkeypatch, fail)
    with pytest.raises(TransientError):
        copy(primary, mirror)
    assert sha256(mirror / REL) == old
    assert temp_files(mirror) == []


# --- fsync and publish faults -----------------------------------------------------------------------------


def _fd_target(fd: int) -> str:
    return str(Path(f"/proc/self/fd/{fd}").readlink())


@pytest.fixture
def failing_part_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """os.fsync fails with EIO the first time it is called on a .part file; later calls are real.

    Yields the inode of every .part fsync attempt. The failed file is held open so that its inode
    number cannot be reused: a second fsync of the same file would show up as a repeated inode.
    """
    real = os.fsync
    inodes: list[int] = []
    held: list[int] = []

    def fsync(fd: int) -> None:
        if _fd_target(fd).endswith(".part"):
            inodes.append(os.fstat(fd).st_ino)
            if not held:
                held.append(os.dup(fd))
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield inodes
    for fd in held:
        assert os.fstat(fd).st_nlink == 0, "the .part whose fsync failed was not discarded"
        os.close(fd)


def test_fsync_failure_discards_the_part(
    primary: Path, mirror: Path, source: Path, failing_part_fsync: list[int]
) -> None:
    with pytest.raises(TransientError) as info:
        copy(primary, mirror)
    assert_names(info.value)
    assert info.value.path == str(mirror / REL) and "Input/output error" in info.value.cause
    assert len(failing_part_fsync) == 1
    assert_no_trace(mirror)


def test_after_fsync_failure_the_retry_rebuilds_from_the_source(
    primary: Path,
    mirror: Path,
    source: Path,
    failing_part_fsync: list[int],
    make_config: Callable[..., Config],
    logs: list[dict[str, Any]],
) -> None:
    """The kernel may have dropped the dirty pages: that file is never fsynced again; a new one is made."""
    config = make_config(
        copy={"max_attempts": 3, "retry_backoff_seconds": 0}, io={"buffer_bytes": CHUNK, "drop_cache": False}
    )
    manifest = Manifest()
    engine = Engine(config, LocalMirror(mirror), manifest, Metrics())
    st = source.stat()
    job = CopyJob(REL, st.st_size, st.st_mtime_ns, 10, "new")
    outcome = copy_all(engine, [job], 1)[REL]
    assert isinstance(outcome, CopyResult)
    first, second = failing_part_fsync
    assert first != second, "the file whose fsync failed was fsynced again"
    assert_mirror_consistent(primary, mirror)
    assert manifest.get(REL) is not None and manifest.get(REL).digest == outcome.digest  # type: ignore[union-attr]
    failed = [e for e in logs if e["event"] == "copy.failed"]
    assert len(failed) == 1 and failed[0]["will_retry"] is True and failed[0]["path"] == REL
    assert "Input/output error" in failed[0]["cause"]
    assert [e["event"] for e in logs if e["event"].startswith("copy.")] == [
        "copy.started",
        "copy.failed",
        "copy.started",
        "copy.committed",
    ]


def test_rename_failure_leaves_no_part(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.replace fails (EIO from a network bridge): no final name, and the .part is removed too."""
    real = os.replace

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        if str(src).endswith(".part"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(TransientError) as info:
        copy(primary, mirror)
    assert_names(info.value)
    assert_no_trace(mirror)


def test_directory_fsync_failure_after_the_rename(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename happened but its durability is unconfirmed: an error, and the name holds the whole file."""
    real = os.fsync
    renamed: list[bool] = []

    def fsync(fd: int) -> None:
        if (mirror / REL).exists() and _fd_target(fd) == str(mirror / "run1"):
            renamed.append(True)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(TransientError) as info:
        copy(primary, mirror)
    assert renamed == [True]
    assert_names(info.value)
    assert_mirror_consistent(primary, mirror)


def test_short_file_on_the_mirror_is_a_size_mismatch(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another actor truncates the .part after the last write (a bridge losing data): caught at seal."""
    size = source.stat().st_size
    part = mirror / (REL + ".part")

    def truncate_at_end(upload: LocalUpload) -> None:
        if upload.written == size:
            os.truncate(part, size // 2)

    hook_writes(monkeypatch, truncate_at_end)
    with pytest.raises(SizeMismatchError) as info:
        copy(primary, mirror)
    assert_names(info.value)
    assert info.value.path == str(mirror / REL)
    assert_no_trace(mirror)


# --- permission denied ------------------------------------------------------------------------------------


def _copy_in_child(primary: str, rel: str, mirror: str) -> str:
    return copy_file(Path(primary), rel, LocalMirror(Path(mirror)), OPTS).digest


def test_permission_denied_on_the_source(world_tmp: Path) -> None:
    """A source the daemon's user may not read (root ignores mode bits, so the copy runs as nobody)."""
    primary, mirror = world_tmp / "primary", world_tmp / "mirror"
    src = save_checkpoint(primary / REL, 10)
    src.chmod(0o000)
    mirror.mkdir()
    mirror.chmod(0o777)
    outcome = run_as_nobody(_copy_in_child, str(primary), REL, str(mirror))
    assert outcome.get("error") == "PermanentError", outcome
    assert outcome["path"] == str(src) and outcome["transient"] is False
    assert "Permission denied" in outcome["cause"] and REL in outcome["text"]
    assert names(mirror) == []


def test_permission_denied_on_the_mirror_names_the_mirror_path(world_tmp: Path) -> None:
    """The operator must be told which side refused: the mirror directory is not writable."""
    primary, mirror = world_tmp / "primary", world_tmp / "mirror"
    save_checkpoint(primary / REL, 10)
    mirror.mkdir()
    outcome = run_as_nobody(_copy_in_child, str(primary), REL, str(mirror))
    assert outcome.get("error") == "PermanentError", outcome
    assert "Permission denied" in outcome["cause"]
    assert outcome["path"] == str(mirror / REL), f"error blames {outcome['path']}"
    assert names(mirror) == []


# --- the source changes during the copy -------------------------------------------------------------------


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _rewrite_same_size(path: Path) -> None:
    """Overwrite the second half in place: same size, same inode; only the mtime tells."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        f.write(bytes(size - size // 2))


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"more optimizer state")


def _replace_by_rename(path: Path) -> None:
    tmp = save_checkpoint(path.with_name("next.pt.tmp"), 11, width=256)
    tmp.replace(path)


@pytest.mark.parametrize(
    "change",
    [_truncate, _rewrite_same_size, _append, _replace_by_rename],
    ids=["truncated", "rewritten-in-place", "appended", "replaced-by-rename"],
)
def test_source_changed_during_the_copy(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch, change: Callable[[Path], None]
) -> None:
    """The trainer touches the file after the copy started: the copy is discarded as source_changed."""
    fired = hook_writes(monkeypatch, once(lambda: change(source)))
    with pytest.raises(SourceChangedError) as info:
        copy(primary, mirror)
    assert fired, "the change was never made"
    assert info.value.reason == "source_changed" and info.value.transient
    assert info.value.path == str(source)
    assert_names(info.value)
    assert_no_trace(mirror)


def test_source_deleted_during_the_copy_is_source_gone(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer rotates the file away mid-copy: discarded, as source_gone (not a failure, not retried)."""
    fired = hook_writes(monkeypatch, once(source.unlink))
    with pytest.raises(SourceGoneError) as info:
        copy(primary, mirror)
    assert fired, "the file was never deleted"
    assert info.value.reason == "source_gone" and not info.value.transient
    assert "deleted while it was being copied" in info.value.cause
    assert_names(info.value)
    assert_no_trace(mirror)


@pytest.mark.parametrize("gone", ["file", "folder"])
def test_source_deleted_before_the_copy_is_source_gone(primary: Path, mirror: Path, source: Path, gone: str) -> None:
    """Listed, then rotated away before a worker opened it (the file, or its whole folder)."""
    if gone == "file":
        source.unlink()
    else:
        shutil.rmtree(source.parent)
    with pytest.raises(SourceGoneError) as info:
        copy(primary, mirror)
    assert "deleted before it was copied" in info.value.cause
    assert_names(info.value)
    assert_no_trace(mirror)


def test_torch_save_in_place_from_another_thread(
    primary: Path, mirror: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real second thread re-saves the checkpoint under the same name mid-copy; the next copy is whole."""
    writer = threading.Thread(target=save_checkpoint, args=(source, 11, 256), name="trainer")

    def resave() -> None:
        writer.start()
        writer.join()

    fired = hook_writes(monkeypatch, once(resave))
    with pytest.raises(SourceChangedError) as info:
        copy(primary, mirror)
    assert fired
    assert_names(info.value)
    assert_no_trace(mirror)
    monkeypatch.undo()
    copy(primary, mirror)
    assert_mirror_consistent(primary, mirror)


@pytest.mark.parametrize("buffer_bytes", [CHUNK, 8 * MiB])
@pytest.mark.parametrize("layout", ["torch.save with a tensor of zeros", "holes at both ends"])
def test_a_sparse_source_is_copied_as_sparse_and_validated_from_the_stream(
    primary: Path, mirror: Path, layout: str, buffer_bytes: int
) -> None:
    """A source with holes goes through the one copy loop: its holes read as zeros (hashed and validated with
    the rest), only its data is written, so the copy reads back identical, verifies, and takes no more blocks
    than its source."""
    path = primary / REL
    path.parent.mkdir(parents=True)
    if layout.startswith("torch"):
        torch.save({"w": torch.randn(256, 256), "zeros": torch.zeros(4 * MiB), "b": torch.randn(256, 256)}, path)
        subprocess.run(["fallocate", "--dig-holes", str(path)], check=True)  # the 16 MiB of zeros become a hole
    else:
        with path.open("wb") as f:
            f.seek(8 * MiB)
            f.write(b"not a zip: sparse test data\n" * 4096)
            f.truncate(20 * MiB)
    source = path.stat()
    assert source.st_blocks * 512 < source.st_size - 8 * MiB, "the source has no holes"
    result = copy(primary, mirror, options=CopyOptions(buffer_bytes=buffer_bytes))
    assert result.validation == ("ok" if layout.startswith("torch") else "unchecked")
    assert (mirror / REL).read_bytes() == path.read_bytes()
    assert result.digest == hash_file(path, "blake3")
    assert (mirror / REL).stat().st_blocks <= source.st_blocks, "the copy is not as sparse as its source"


# --- stop requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reason", "error_type"), [("stalled", StalledError), ("cancelled", CancelledError)])
def test_stop_request_aborts_at_the_next_chunk(
    primary: Path,
    mirror: Path,
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
    reason: str,
    error_type: type[MirrordError],
) -> None:
    control = CopyControl()
    hook_writes(monkeypatch, once(lambda: control.stop(reason)))
    with pytest.raises(error_type) as info:
        copy(primary, mirror, control=control)
    assert_names(info.value)
    assert_no_trace(mirror)
    assert 0 < control.bytes_done < source.stat().st_size


def test_a_gated_copy_is_held_in_its_stream_on_the_path_a_local_copy_takes(
    mirror: Path, gated_primary: FuseMount
) -> None:
    """The FUSE gate the host tests hold copies with: it reports the file's blocks (a file with none would be
    copied as a sparse one), and holds the stream where it is told, while the validator reads the zip's
    directory and record headers (beyond the gate, from the copy's write thread) through it."""
    source = publish_checkpoint(gated_primary.backing / REL, 10, megabytes=40)
    assert (gated_primary.mount_point / REL).stat().st_blocks == source.stat().st_blocks
    gated_primary.stall(source.name, after=20 * MiB)
    control, done = CopyControl(), []
    options = CopyOptions(buffer_bytes=8 * MiB)  # two 4 MiB buffers, as the daemon's defaults
    copier = threading.Thread(
        target=lambda: done.append(copy(gated_primary.mount_point, mirror, options=options, control=control))
    )
    copier.start()
    try:
        # A validator held at the gate would hold the copy at its second buffer (8 MiB).
        wait_for(lambda: control.bytes_done >= 16 * MiB, 120, "the copy streaming up to the gate")
        assert copier.is_alive() and control.bytes_done <= 20 * MiB, "the gate let the copy through"
    finally:
        gated_primary.unstall()
        copier.join(120)
    assert done and done[0].validation == "ok", done
    assert_mirror_consistent(gated_primary.backing, mirror)


# --- leftovers and symlinks -------------------------------------------------------------------------------


def test_stale_part_is_replaced(primary: Path, mirror: Path, source: Path) -> None:
    """A NAME.part left by a dead copy (larger than the source) never leaks into the new copy."""
    part = mirror / (REL + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(os.urandom(3 * source.stat().st_size))
    copy(primary, mirror)
    assert_mirror_consistent(primary, mirror)
    assert names(mirror / "run1") == ["step_0010.pt"]


def test_stale_part_that_is_a_symlink_is_not_written_through(
    primary: Path, mirror: Path, source: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"precious")
    (mirror / "run1").mkdir()
    (mirror / (REL + ".part")).symlink_to(secret)
    copy(primary, mirror)
    assert secret.read_bytes() == b"precious"
    assert_mirror_consistent(primary, mirror)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A secret checkpoint and a secret run folder outside both roots."""
    path = tmp_path / "outside"
    save_checkpoint(path / "secret.pt", 999)
    save_checkpoint(path / "run" / "step_0100.pt", 100)
    return path


def test_symlinked_file_in_the_primary_is_never_copied(
    primary: Path, mirror: Path, source: Path, outside: Path
) -> None:
    (primary / "run1" / "step_0099.pt").symlink_to(outside / "secret.pt")
    with pytest.raises(PermanentError, match="symlink") as info:
        copy(primary, mirror, "run1/step_0099.pt")
    assert_names(info.value, "run1/step_0099.pt")
    assert_no_trace(mirror, "run1/step_0099.pt")


def test_symlinked_directory_in_the_primary_is_never_entered(
    primary: Path, mirror: Path, source: Path, outside: Path
) -> None:
    (primary / "linked_run").symlink_to(outside / "run")
    with pytest.raises(PermanentError, match="symlink") as info:
        copy(primary, mirror, "linked_run/step_0100.pt")
    assert_names(info.value, "linked_run/step_0100.pt")
    assert names(mirror) == []


def test_sync_skips_planted_symlinks(
    primary: Path,
    mirror: Path,
    source: Path,
    outside: Path,
    make_config: Callable[..., Config],
    logs: list[dict[str, Any]],
) -> None:
    """A whole pass: the real checkpoint is mirrored, nothing reachable only through a link is."""
    (primary / "run1" / "step_0099.pt").symlink_to(outside / "secret.pt")
    (primary / "linked_run").symlink_to(outside / "run")
    report = run_sync(make_config())
    assert report.ok and report.copied == [REL]
    assert sorted(mirror_files(mirror)) == [REL]
    secret_digests = {sha256(p) for p in outside.rglob("*.pt")}
    assert not secret_digests & {sha256(p) for p in mirror_files(mirror).values()}
    skipped = sorted(e["path"] for e in logs if e["event"] == "scan.skipped")
    assert skipped == ["linked_run", "run1/step_0099.pt"]
    assert_mirror_consistent(primary, mirror)


def test_symlink_planted_on_the_mirror_is_not_written_through(
    primary: Path, mirror: Path, source: Path, tmp_path: Path
) -> None:
    """mirror/run1 -> elsewhere: the copy fails rather than create files outside the mirror."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (mirror / "run1").symlink_to(elsewhere)
    with pytest.raises(PermanentError) as info:
        copy(primary, mirror)
    assert REL in str(info.value)
    assert names(elsewhere) == []


# --- a truncated file already under a final name ----------------------------------------------------------


@pytest.fixture
def two_steps(primary: Path) -> tuple[Path, Path]:
    return save_checkpoint(primary / "run1" / "step_0009.pt", 9), save_checkpoint(primary / REL, 10)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "left-by-cp"])
def test_truncated_final_file_on_the_mirror_is_skipped_by_latest_and_replaced_by_sync(
    primary: Path,
    mirror: Path,
    two_steps: tuple[Path, Path],
    make_config: Callable[..., Config],
    logs: list[dict[str, Any]],
    recorded: bool,
) -> None:
    """The incident: a prefix of step_0010 sits under its final name. latest skips it; sync mends it."""
    config = make_config()
    assert run_sync(config).ok
    target = mirror / REL
    if not recorded:  # as if an old `cp` had put it there: the manifest does not know it
        mirror_obj = LocalMirror(mirror)
        mirror_obj.read_manifest().remove(REL)
    with target.open("r+b") as f:
        f.truncate(target.stat().st_size * 3 // 4)
    assert latest_checkpoint(mirror) == mirror / "run1" / "step_0009.pt"
    logs.clear()
    report = run_sync(config)
    assert report.ok and report.copied == [REL]
    whys = [e["why"] for e in logs if e["event"] == "copy.started"]
    assert whys == ["mirror_mismatch" if recorded else "unrecorded"]
    assert latest_checkpoint(mirror) == target
    assert_mirror_consistent(primary, mirror)


# --- free space, on a real small filesystem ---------------------------------------------------------------


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_not_enough_space_is_refused_before_writing(primary: Path, small_tmpfs: Path) -> None:
    """6.3 MB + 4 MiB reserve > 8 MiB: NoSpaceError up front; the mirror is not touched at all."""
    save_checkpoint(primary / REL, 10, width=512)
    free_before = _free(small_tmpfs)
    options = CopyOptions(algo="blake3", buffer_bytes=CHUNK, reserve_bytes=4 * 2**20)
    with pytest.raises(NoSpaceError) as info:
        copy(primary, small_tmpfs, options=options)
    assert info.value.path == str(small_tmpfs / REL)
    assert "free" in info.value.cause and "reserve" in info.value.cause
    assert names(small_tmpfs) == []
    assert _free(small_tmpfs) == free_before


def test_real_enospc_mid_copy(primary: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check passes (reserve 0), then another writer fills the disk: the kernel's own ENOSPC."""
    source = save_checkpoint(primary / REL, 10, width=512)
    assert _free(small_tmpfs) > source.stat().st_size
    filler = small_tmpfs / ".filler"

    def fill_the_disk() -> None:
        with filler.open("wb") as f:
            block = bytes(2**20)
            try:
                while True:
                    f.write(block)
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC

    fired = hook_writes(monkeypatch, once(fill_the_disk))
    with pytest.raises(NoSpaceError) as info:
        copy(primary, small_tmpfs)
    assert fired
    assert info.value.path == str(small_tmpfs / REL)
    assert "No space left" in info.value.cause
    assert_no_trace(small_tmpfs)
    filler.unlink()
    monkeypatch.undo()
    copy(primary, small_tmpfs)
    assert_mirror_consistent(primary, small_tmpfs)


def test_sync_onto_a_disk_too_small_for_both(
    primary: Path, small_tmpfs: Path, make_config: Callable[..., Config]
) -> None:
    """Two 4.8 MB checkpoints, 8 MiB of space: the newest is published whole and recorded, the other is
    refused as no_space before a byte is written, and nothing is left half-written."""
    for step in (1, 2):
        save_checkpoint(primary / f"run{step}" / f"step_{step}.pt", step, width=448)
    config = make_config(
        mirror=str(small_tmpfs),
        copy={"workers": 1, "max_attempts": 1, "free_space_reserve_bytes": 0},
        io={"buffer_bytes": CHUNK, "drop_cache": False},
    )
    report = run_sync(config)
    assert not report.ok
    assert report.copied == ["run2/step_2.pt"]
    assert list(report.failed) == ["run1/step_1.pt"]
    # Human units for the reader, exact bytes for the arithmetic: "mirror has 3.4 MiB (3547136 bytes) free".
    assert re.search(
        r"mirror has \d+\.\d MiB \(\d+ bytes\) free; needs \d+\.\d MiB \(\d+ bytes\)", report.failed["run1/step_1.pt"]
    ), report.failed["run1/step_1.pt"]
    assert sorted(Manifest.load(small_tmpfs).entries) == ["run2/step_2.pt"]
    assert_mirror_consistent(primary, small_tmpfs)
