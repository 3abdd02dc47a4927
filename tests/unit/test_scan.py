"""Scanning: committed candidates by lstat; temp, hidden, symlinked and special files never count."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mirrord.store.scan import is_candidate_name, snapshot_tree
from tests.support.deep import deeper_than_path_max
from tests.support.privileges import run_as_nobody

PATTERNS = ("*.pt",)


@pytest.mark.parametrize(
    ("name", "candidate"),
    [
        ("step_0010.pt", True),
        ("step_0010.pt.part", False),
        ("step_0010.pt.tmp", False),
        (".step_0010.pt", False),
        ("step_0010.ckpt", False),
        ("notes.txt", False),
    ],
)
def test_is_candidate_name(name: str, candidate: bool) -> None:
    assert is_candidate_name(name, PATTERNS) is candidate


def test_patterns_never_admit_temp_or_hidden_names() -> None:
    """Even a catch-all pattern does not make a temp or hidden file a checkpoint."""
    assert not is_candidate_name("x.part", ("*",))
    assert not is_candidate_name("x.tmp", ("*",))
    assert not is_candidate_name(".mirrord-manifest.json", ("*",))
    assert is_candidate_name("model.ckpt", ("*.pt", "*.ckpt"))


def test_snapshot_lists_committed_files_with_their_stat(tmp_path: Path) -> None:
    (tmp_path / "run_a").mkdir()
    (tmp_path / "run_a" / "nested").mkdir()
    (tmp_path / "top.pt").write_bytes(b"1")
    (tmp_path / "run_a" / "step_0001.pt").write_bytes(b"22")
    (tmp_path / "run_a" / "nested" / "step_0002.pt").write_bytes(b"333")
    os.utime(tmp_path / "top.pt", ns=(5, 123_456_789))
    snap = snapshot_tree(tmp_path, PATTERNS)
    assert sorted(snap.files) == ["run_a/nested/step_0002.pt", "run_a/step_0001.pt", "top.pt"]
    top = snap.files["top.pt"]
    st = (tmp_path / "top.pt").stat()
    assert (top.size, top.mtime_ns, top.ino, top.dev) == (1, 123_456_789, st.st_ino, st.st_dev)
    assert top.run == "" and snap.files["run_a/nested/step_0002.pt"].run == "run_a/nested"
    assert snap.complete and snap.errors == () and snap.skipped == ()


def test_snapshot_ignores_temp_hidden_and_unmatched_files(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / ".hidden_run").mkdir()
    for name in ("step_1.pt.part", "step_1.pt.tmp", ".step_1.pt", "step_1.txt", "step_1.pt"):
        (tmp_path / "run" / name).write_bytes(b"x")
    (tmp_path / ".hidden_run" / "step_2.pt").write_bytes(b"x")
    snap = snapshot_tree(tmp_path, PATTERNS)
    assert list(snap.files) == ["run/step_1.pt"]
    assert snap.partials == {}
    assert snap.complete


def test_partials_are_collected_on_request(tmp_path: Path) -> None:
    """The mirror side wants its leftover NAME.part files (to sweep them); never as checkpoints."""
    (tmp_path / "step_1.pt.part").write_bytes(b"half")
    (tmp_path / "step_2.pt").write_bytes(b"whole")
    snap = snapshot_tree(tmp_path, PATTERNS, collect_partials=True)
    assert list(snap.partials) == ["step_1.pt.part"] and snap.partials["step_1.pt.part"].size == 4
    assert list(snap.files) == ["step_2.pt"]


def test_symlinks_are_skipped_never_followed(tmp_path: Path) -> None:
    """A link to a file or a directory outside the root is reported, not listed and not entered."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.pt").write_bytes(b"secret")
    (outside / "step_9.pt").write_bytes(b"secret too")
    (root / "step_1.pt").symlink_to(outside / "secret.pt")
    (root / "linked_run").symlink_to(outside)
    (root / "dangling.pt").symlink_to(tmp_path / "nowhere")
    snap = snapshot_tree(root, PATTERNS)
    assert snap.files == {}
    assert sorted(snap.skipped) == [
        ("dangling.pt", "symlink"),
        ("linked_run", "symlink"),
        ("step_1.pt", "symlink"),
    ]
    assert snap.complete


def test_the_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    """The operator chose the root; only links below it are refused."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "step_1.pt").write_bytes(b"x")
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert list(snapshot_tree(tmp_path / "alias", PATTERNS).files) == ["step_1.pt"]


def test_fifos_and_sockets_are_skipped(tmp_path: Path) -> None:
    """Opening a FIFO would block the scanner forever; a socket has no bytes to copy."""
    os.mkfifo(tmp_path / "step_1.pt")
    os.mkfifo(tmp_path / "other_fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "step_2.pt"))
        snap = snapshot_tree(tmp_path, PATTERNS)
    assert snap.files == {}
    assert sorted(snap.skipped) == [("step_1.pt", "not a regular file"), ("step_2.pt", "not a regular file")]


def test_a_directory_named_like_a_checkpoint_is_entered_not_listed(tmp_path: Path) -> None:
    (tmp_path / "odd.pt").mkdir()
    (tmp_path / "odd.pt" / "step_1.pt").write_bytes(b"x")
    assert list(snapshot_tree(tmp_path, PATTERNS).files) == ["odd.pt/step_1.pt"]


def test_missing_root_is_an_error_not_an_empty_volume(tmp_path: Path) -> None:
    """An unmounted volume must not look like one with no checkpoints (that would license pruning)."""
    snap = snapshot_tree(tmp_path / "absent", PATTERNS)
    assert snap.files == {}
    assert not snap.complete
    assert len(snap.errors) == 1 and str(tmp_path / "absent") in snap.errors[0]


def _scan(root: str) -> dict[str, object]:
    snap = snapshot_tree(Path(root), PATTERNS)
    return {"files": sorted(snap.files), "errors": list(snap.errors)}


def test_unreadable_directory_is_collected_as_an_error(world_tmp: Path) -> None:
    """The listing goes on past an unreadable run folder and reports it (scan runs as nobody)."""
    (world_tmp / "open").mkdir()
    (world_tmp / "locked").mkdir()
    (world_tmp / "open" / "step_1.pt").write_bytes(b"x")
    (world_tmp / "locked" / "step_2.pt").write_bytes(b"x")
    (world_tmp / "locked").chmod(0o700)
    result = run_as_nobody(_scan, str(world_tmp))["value"]
    assert result["files"] == ["open/step_1.pt"]
    [error] = result["errors"]
    assert str(world_tmp / "locked") in error and "Permission denied" in error


@pytest.mark.parametrize(
    "name",
    [
        "step_1.pt",
        "a[1].pt",
        "model.safetensors",
        "x.PT",
        "ckpt-7",
        "a\nb.pt",
        "step_1.pt.bak",
        "weird*name?.ckpt",
        "résumé.pt",
    ],
)
def test_patterns_match_as_fnmatchcase_would(name: str) -> None:
    """The patterns are matched as one compiled regex; the verdict is fnmatchcase's, pattern by pattern."""
    import fnmatch

    patterns = ("*.pt", "ckpt-[0-9]", "*[?]*.ckpt", "model.safe*")
    assert is_candidate_name(name, patterns) is any(fnmatch.fnmatchcase(name, p) for p in patterns)
    assert not is_candidate_name(name, ())


def test_a_rescan_sees_every_change_since_the_last_listing(tmp_path: Path) -> None:
    """A file unchanged is listed as before; a rewritten, touched or replaced file as what it is now; a
    file gone is gone."""
    for name in ("same.pt", "grown.pt", "touched.pt", "replaced.pt", "gone.pt"):
        (tmp_path / name).write_bytes(b"x")
    before = snapshot_tree(tmp_path, PATTERNS).files
    with (tmp_path / "grown.pt").open("ab") as f:
        f.write(b"y")
    st = (tmp_path / "touched.pt").stat()
    os.utime(tmp_path / "touched.pt", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    (tmp_path / "new.pt").write_bytes(b"x")
    (tmp_path / "new.pt").replace(tmp_path / "replaced.pt")
    (tmp_path / "gone.pt").unlink()
    after = snapshot_tree(tmp_path, PATTERNS).files
    assert sorted(after) == ["grown.pt", "replaced.pt", "same.pt", "touched.pt"]
    assert after["same.pt"] == before["same.pt"]
    assert after["grown.pt"].size == 2 and after["touched.pt"].mtime_ns == st.st_mtime_ns + 1
    assert after["replaced.pt"].ino != before["replaced.pt"].ino


def _open_descriptors() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_a_folder_swapped_for_a_symlink_during_the_walk_is_an_error_never_followed(tmp_path: Path) -> None:
    """Folders are opened beneath their parent with O_NOFOLLOW: a run folder replaced by a symlink to
    another tree after it was listed (a race with an operator or a hostile job) is reported, and
    nothing outside the root is listed."""
    from mirrord.store import scan

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run_a").mkdir(parents=True)
    (root / "run_a" / "step_1.pt").write_bytes(b"a")
    outside.mkdir()
    (outside / "step_9.pt").write_bytes(b"x")
    errors: list[str] = []
    walk = scan._walk(root, errors)
    _fd, rel, _entries, subdirs = next(walk)
    assert rel == ""
    subdirs.append("run_a")
    (root / "run_a").rename(tmp_path / "moved")
    (root / "run_a").symlink_to(outside)
    assert list(walk) == []
    assert len(errors) == 1
    assert f"{root / 'run_a'}: cannot list:" in errors[0]


def test_the_walk_holds_one_descriptor_per_level_and_closes_them_all(tmp_path: Path) -> None:
    """Many sibling folders do not hold a descriptor each (1,000 runs would near a default ulimit), and
    a walk stopped midway (an exception in the caller) leaves none open."""
    from mirrord.store import scan

    for i in range(50):
        (tmp_path / f"run_{i:02d}" / "sub").mkdir(parents=True)
        (tmp_path / f"run_{i:02d}" / "sub" / "step_1.pt").write_bytes(b"1")
    before = _open_descriptors()
    most = 0
    for _fd, _rel, entries, subdirs in scan._walk(tmp_path, []):
        most = max(most, _open_descriptors() - before)
        subdirs.extend(e.name for e in entries if e.is_dir())
    assert most <= 3  # the root, a run folder, its sub folder
    assert _open_descriptors() == before
    walk = scan._walk(tmp_path, [])
    _fd, _rel, entries, subdirs = next(walk)
    subdirs.extend(e.name for e in entries if e.is_dir())
    next(walk)
    walk.close()
    assert _open_descriptors() == before
    assert len(snapshot_tree(tmp_path, PATTERNS).files) == 50
    assert _open_descriptors() == before


def test_the_walk_visits_folders_in_the_order_a_stack_would(tmp_path: Path) -> None:
    """Depth first, last-listed folder first: the order the listing had before it walked by descriptor
    (Snapshot.files keeps insertion order, and a rescan's records come in the same order)."""
    from mirrord.store import scan

    for rel in ("a/x", "a/y", "b", "c/z/deep"):
        (tmp_path / rel).mkdir(parents=True)
    visited = []
    for _fd, rel, entries, subdirs in scan._walk(tmp_path, []):
        visited.append(rel)
        subdirs.extend(sorted(e.name for e in entries if e.is_dir()))
    assert visited == ["", "c", "c/z", "c/z/deep", "b", "a", "a/y", "a/x"]


def test_a_folder_deeper_than_a_path_can_name_is_a_listing_error(tmp_path: Path) -> None:
    """The walk by descriptor could go on below PATH_MAX, but no path (a trainer's, cp's, the copy's
    messages) could name what it found: such a folder is unlistable, the view partial, as it was by path."""
    fd = deeper_than_path_max(tmp_path)
    os.close(os.open("step_1.pt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    (tmp_path / "step_0.pt").write_bytes(b"0")
    snap = snapshot_tree(tmp_path, PATTERNS)
    assert list(snap.files) == ["step_0.pt"]
    [error] = snap.errors
    assert error.endswith(f": cannot list: {os.strerror(36)}") and not snap.complete


@pytest.mark.parametrize("short", [False, True])
def test_the_longest_nameable_folder_is_listed_and_one_byte_more_is_an_error(tmp_path: Path, short: bool) -> None:
    """The limit is on the folder's whole path as bytes (a multi-byte name counts its bytes): 4095 bytes are
    listed, 4096 are not."""
    room = 4095 - len(os.fsencode(tmp_path)) - 1  # bytes of the relative path at the limit
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    rel: list[str] = []
    while room - sum(len(os.fsencode(p)) + 1 for p in rel) > 250:
        part = "é" * 100 if len(rel) % 2 else "d" * 200  # (é: two bytes)
        os.mkdir(part, dir_fd=fd)
        child = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd, rel = child, [*rel, part]
    last = "x" * (room - sum(len(os.fsencode(p)) + 1 for p in rel) + (0 if short else 1))
    os.mkdir(last, dir_fd=fd)
    os.close(os.open(f"{last}/step_1.pt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    snap = snapshot_tree(tmp_path, PATTERNS)
    if short:
        assert len(os.fsencode(tmp_path / "/".join([*rel, last]))) == 4095
        assert list(snap.files) == ["/".join([*rel, last, "step_1.pt"])] and snap.complete
    else:
        assert not snap.files and not snap.complete
        [error] = snap.errors
        assert error.endswith(f": cannot list: {os.strerror(36)}")


NAMES = (
    "step_1.pt",
    "a.pt",
    "pt",
    ".pt",
    "t",
    ".a.pt",
    "a.pt.part",
    "a.part",
    ".a.part",
    "part",
    ".part",
    "a.pt.tmp",
    "a.tmp",
    "a.PT",
    "a.pth",
    "a.ckpt",
    "a.safetensors",
    "a.pa",
    "latest",
    "last.ckpt",
    "step_2.bin",
    "x",
    "résumé.pt",
    "a\nb.pt",
)


@pytest.mark.parametrize(
    "patterns",
    [
        ("*.pt",),
        ("*.pt", "*.pa"),
        ("*.pt", "*.ckpt"),
        ("*t",),
        ("*",),
        ("*.tmp",),
        ("*art",),
        ("step_*",),
        ("*.pt", "step_?.bin"),
    ],
)
@pytest.mark.parametrize("layout", ["none", "torch", "lightning", "deepspeed"])
def test_a_listing_selects_each_name_as_the_one_name_rules_do(
    tmp_path: Path, patterns: tuple[str, ...], layout: str
) -> None:
    """The scan's inlined name tests (a slice and a set lookup where the patterns allow) select exactly what
    is_selected_name selects, with or without a file layout, and collect exactly the NAME.part files."""
    from mirrord.layouts import layout_for
    from mirrord.store.scan import is_selected_name

    rules = None if layout == "none" else layout_for(layout, patterns)
    for name in NAMES:
        (tmp_path / name).write_bytes(b"x")
    for collect in (False, True):
        snap = snapshot_tree(tmp_path, patterns, collect_partials=collect, layout=rules)
        partial = {n for n in NAMES if collect and n.endswith(".part") and not n.startswith(".")}
        assert set(snap.partials) == partial
        assert set(snap.files) == {
            n for n in NAMES if n not in partial and is_selected_name(n, patterns, rules, in_unit=False)
        }
