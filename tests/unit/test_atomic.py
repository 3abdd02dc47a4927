"""The durability protocol: NAME.part in the same directory, fsync, replace, fsync the directory."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from mirrord.store import atomic
from tests.support.mirror import names


class BoomError(Exception):
    pass


def _fd_path(fd: int) -> str:
    return str(Path(f"/proc/self/fd/{fd}").readlink())


def test_temp_path_is_next_to_the_final_name(tmp_path: Path) -> None:
    """Same directory, hence same filesystem: the rename is atomic."""
    final = tmp_path / "run" / "step_0010.pt"
    assert atomic.temp_path(final) == tmp_path / "run" / "step_0010.pt.part"
    assert atomic.temp_name("x") == "x" + atomic.TEMP_SUFFIX


def test_atomic_output_publishes_the_whole_file(tmp_path: Path) -> None:
    final = tmp_path / "data.bin"
    with atomic.atomic_output(final) as f:
        f.write(b"a" * 1000)
        assert not final.exists(), "the final name exists before the block completed"
        assert atomic.temp_path(final).read_bytes() == b""  # buffered, not yet flushed
    assert final.read_bytes() == b"a" * 1000
    assert names(tmp_path) == ["data.bin"]


def test_durability_order_fsync_file_replace_fsync_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is on disk before it gets its name, and the name is on disk before we return."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", _fd_path(fd)))
        real_fsync(fd)

    def replace(src: str, dst: str, **kwargs: object) -> None:
        events.append(("replace", f"{src}->{dst}"))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = tmp_path / "m.json"
    atomic.write_bytes_atomic(final, b"{}")
    assert events == [
        ("fsync", str(tmp_path / "m.json.part")),
        ("replace", "m.json.part->m.json"),
        ("fsync", str(tmp_path)),
    ]


@pytest.mark.parametrize("exc_type", [BoomError, KeyboardInterrupt])
def test_exception_removes_the_part_and_keeps_the_previous_file(tmp_path: Path, exc_type: type[BaseException]) -> None:
    """A failed rewrite leaves the old complete file; the exception is the caller's own."""
    final = tmp_path / "data.bin"
    final.write_bytes(b"old complete content")
    with pytest.raises(exc_type), atomic.atomic_output(final) as f:
        f.write(b"new, half")
        f.flush()
        assert atomic.temp_path(final).exists()
        raise exc_type()
    assert final.read_bytes() == b"old complete content"
    assert names(tmp_path) == ["data.bin"]


def test_original_error_survives_a_failing_cleanup(tmp_path: Path) -> None:
    """If the .part is already gone, removing it fails silently and the first error propagates."""
    final = tmp_path / "data.bin"
    with pytest.raises(BoomError), atomic.atomic_output(final):
        atomic.temp_path(final).unlink()
        raise BoomError()
    assert names(tmp_path) == []


def test_fsync_failure_discards_the_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO from fsync: the data may be lost, so nothing is published and the .part is removed."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if _fd_path(fd).endswith(".part"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = tmp_path / "data.bin"
    with pytest.raises(OSError, match="Input/output error"):
        atomic.write_bytes_atomic(final, b"x" * 100)
    assert names(tmp_path) == []


def test_stale_part_from_a_dead_writer_is_replaced(tmp_path: Path) -> None:
    final = tmp_path / "data.bin"
    atomic.temp_path(final).write_bytes(b"junk from a writer that died" * 1000)
    atomic.write_bytes_atomic(final, b"fresh")
    assert final.read_bytes() == b"fresh"
    assert names(tmp_path) == ["data.bin"]


def test_stale_part_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """A planted NAME.part -> secret is replaced, never written through."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"do not touch")
    (tmp_path / "out").mkdir()
    final = tmp_path / "out" / "data.bin"
    atomic.temp_path(final).symlink_to(secret)
    atomic.write_bytes_atomic(final, b"fresh")
    assert secret.read_bytes() == b"do not touch"
    assert final.read_bytes() == b"fresh" and not final.is_symlink()
    assert names(tmp_path / "out") == ["data.bin"]


def test_final_name_that_is_a_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    """rename() replaces the link itself: the target outside keeps its content."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"do not touch")
    (tmp_path / "out").mkdir()
    final = tmp_path / "out" / "data.bin"
    final.symlink_to(secret)
    atomic.write_bytes_atomic(final, b"fresh")
    assert secret.read_bytes() == b"do not touch"
    assert final.read_bytes() == b"fresh" and not final.is_symlink()


def test_publish_refuses_when_the_part_was_replaced(tmp_path: Path) -> None:
    """Someone swapped NAME.part for another file mid-write: that file must not get the final name."""
    final = tmp_path / "data.bin"
    with pytest.raises(FileExistsError), atomic.atomic_output(final) as f:
        f.write(b"ours")
        part = atomic.temp_path(final)
        part.unlink()
        part.write_bytes(b"theirs")
    assert not final.exists()
    assert part.read_bytes() == b"theirs", "the other writer's file was deleted by our cleanup"


def test_discard_temp_leaves_a_file_that_is_not_ours(tmp_path: Path) -> None:
    """With the fd, discard removes the temp name only while it still is that file."""
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = atomic.create_temp(dir_fd, "x")
        try:
            (tmp_path / "x.part").unlink()
            (tmp_path / "x.part").write_bytes(b"a retry's temp file")
            atomic.discard_temp(dir_fd, "x", fd)
            assert (tmp_path / "x.part").exists()
            atomic.discard_temp(dir_fd, "x")
            assert not (tmp_path / "x.part").exists()
            atomic.discard_temp(dir_fd, "x")  # already gone: no error
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def test_create_temp_is_exclusive_and_regular(tmp_path: Path) -> None:
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = atomic.create_temp(dir_fd, "x", 0o600)
        try:
            st = os.fstat(fd)
            assert stat.S_ISREG(st.st_mode) and st.st_size == 0
            named = (tmp_path / "x.part").stat()
            assert (st.st_dev, st.st_ino) == (named.st_dev, named.st_ino)
            with pytest.raises(FileExistsError):
                os.open("x.part", os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def test_fsync_dir_accepts_only_a_directory(tmp_path: Path) -> None:
    atomic.fsync_dir(tmp_path)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        atomic.fsync_dir(tmp_path / "f")


# --- a group of small files: fsyncs and renames left to DirSyncs.flush() ------------------------------
def _upload_group(root: Path, sizes: dict[str, int]) -> atomic.DirSyncs:
    """Copies written, sealed and committed into one group, as the copier does: nothing flushed yet."""
    from mirrord.store.volume import LocalMirror

    mirror, dirs = LocalMirror(root), atomic.DirSyncs()
    for rel, size in sizes.items():
        upload = mirror.begin_upload(rel, size, drop_cache=True)
        upload.write(memoryview(bytes([len(rel)]) * size))
        upload.seal(1_700_000_000_000_000_000)
        upload.commit(dirs)
    return dirs


def _record_syscalls(
    monkeypatch: pytest.MonkeyPatch, fail_fsync_of: str | None = None, syncfs: bool = False
) -> list[tuple[str, str]]:
    """fsync, syncfs and os.replace as they are called, by path; with `syncfs` false the platform has none
    (a group's files and directories are fsynced one by one)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        if fail_fsync_of is not None and path.endswith(fail_fsync_of):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        events.append(("fsync", path))
        real_fsync(fd)

    def syncfs_(fd: int) -> None:
        if fail_fsync_of is not None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        events.append(("syncfs", _fd_path(fd)))
        os.sync()  # what syncfs does, for every filesystem

    def replace(src: str, dst: str, **kwargs: object) -> None:
        events.append(("replace", dst))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(atomic, "_syncfs", syncfs_ if syncfs else None)
    return events


@pytest.mark.parametrize("syncfs", [True, False], ids=["syncfs", "no-syncfs"])
def test_a_group_of_small_files_is_renamed_only_after_every_fsync_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: bool
) -> None:
    """Sealing and committing a small copy into a group neither fsyncs nor renames it; flush() makes
    every file of the group durable (one syncfs for them all, else an fsync each), then renames them,
    then makes each directory durable (one syncfs, else an fsync of each)."""
    events = _record_syscalls(monkeypatch, syncfs=syncfs)
    dirs = _upload_group(tmp_path, {"a/s1.pt": 1000, "a/s2.pt": 5000, "b/s3.pt": 0})
    assert [e for e in events if e[0] == "replace" or e[1].endswith(".part")] == []  # created folders were fsynced
    assert dirs.renames_pending()
    assert names(tmp_path / "a") == ["s1.pt.part", "s2.pt.part"] and names(tmp_path / "b") == ["s3.pt.part"]
    events.clear()
    dirs.flush()
    parts = [str(tmp_path / f"{rel}.part") for rel in ("a/s1.pt", "a/s2.pt", "b/s3.pt")]
    renames = [("replace", "s1.pt"), ("replace", "s2.pt"), ("replace", "s3.pt")]
    if syncfs:  # one for the files (through one of them), one for the two directories
        assert events[0][0] == "syncfs" and events[0][1] in parts
        assert events[1:4] == renames
        assert events[4][0] == "syncfs" and events[4][1] in (str(tmp_path / "a"), str(tmp_path / "b"))
        assert len(events) == 5
    else:
        assert events[:3] == [("fsync", part) for part in parts]
        assert events[3:6] == renames
        assert sorted(events[6:]) == [("fsync", str(tmp_path / "a")), ("fsync", str(tmp_path / "b"))]
    assert not dirs.renames_pending()
    assert (tmp_path / "a" / "s2.pt").read_bytes() == bytes([7]) * 5000
    assert names(tmp_path / "a") == ["s1.pt", "s2.pt"] and names(tmp_path / "b") == ["s3.pt"]


@pytest.mark.parametrize("syncfs", [True, False], ids=["syncfs", "no-syncfs"])
def test_a_failed_fsync_in_a_group_publishes_none_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: bool
) -> None:
    """EIO from the group's syncfs, or from one file's fsync: data may be lost, and no file of the group
    gets its final name (the previous copy under that name stays); every temp file is removed."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "s1.pt").write_bytes(b"previous copy")
    events = _record_syscalls(monkeypatch, fail_fsync_of="s2.pt.part", syncfs=syncfs)
    dirs = _upload_group(tmp_path, {"a/s1.pt": 1000, "a/s2.pt": 1000, "a/s3.pt": 1000})
    events.clear()
    with pytest.raises(OSError, match="Input/output error"):
        dirs.flush()
    dirs.close()
    assert events == ([] if syncfs else [("fsync", str(tmp_path / "a" / "s1.pt.part"))])  # nothing renamed
    assert names(tmp_path / "a") == ["s1.pt"] and (tmp_path / "a" / "s1.pt").read_bytes() == b"previous copy"


def test_a_group_closed_without_flush_leaves_no_final_name(tmp_path: Path) -> None:
    """A batch that is not committed (a cancelled copy, a commit that failed before the files) leaves
    neither a final name nor a temp file."""
    dirs = _upload_group(tmp_path, {"a/s1.pt": 1000, "s2.pt": 10})
    dirs.close()
    assert names(tmp_path) == ["a"] and names(tmp_path / "a") == []


def test_a_small_file_committed_alone_is_fsynced_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a group, commit() makes the fsync seal() left: file, rename, directory. A file larger than
    DEFER_FSYNC_MAX_BYTES is fsynced by seal() itself."""
    from mirrord.store import upload, volume

    monkeypatch.setattr(upload, "DEFER_FSYNC_MAX_BYTES", 4096)
    events = _record_syscalls(monkeypatch)
    mirror = volume.LocalMirror(tmp_path)
    for name, size in (("small.pt", 4096), ("big.pt", 4097)):
        upload = mirror.begin_upload(name, size)
        upload.write(memoryview(b"x" * size))
        upload.seal(1_700_000_000_000_000_000)
        sealed = list(events)
        upload.commit()
        assert sealed == ([] if name == "small.pt" else [("fsync", str(tmp_path / "big.pt.part"))])
        assert events[-3:] == [("fsync", str(tmp_path / f"{name}.part")), ("replace", name), ("fsync", str(tmp_path))]
        events.clear()
    assert names(tmp_path) == ["big.pt", "small.pt"]
