"""A listing made by a child process: the same snapshot as one made here, and never worse than one made here.

Every test starts real child interpreters (or real commands that fail as a child can): the child is an
optimisation, so a child that cannot start, dies or answers nonsense must give the listing made here.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest

import mirrord
from mirrord.core.layouts import Layout, layout_for
from mirrord.core.model import Snapshot
from mirrord.store import listing_child
from mirrord.store.listing_child import CHILD_MAX_FILES, CHILD_MIN_FILES, PendingListing, start_listing
from mirrord.store.scan import snapshot_tree
from mirrord.store.volume import LocalVolume
from tests.support.wait import wait_for


def _tree(root: Path) -> Path:
    """A tree with everything a listing reports: files, partials, hidden and temp names, a symlink, a FIFO,
    a socket, folder units being staged and a look-alike file."""
    for rel, data in {"run_a/step_0001.pt": b"1", "run_a/step_0002.pt": b"22", "run_a/step_0003.pt.part": b"h",
                      "run_a/.step_0004.pt": b"x", "run_a/notes.txt": b"n", ".hidden/step_0005.pt": b"x",
                      "run_b/deep/er/step_0010.pt": b"333", "run_b/checkpoint-7/model.safetensors": b"m",
                      "run_b/checkpoint-7/trainer_state.json": b"{}", "run_b/checkpoint-8.part/model.safetensors": b"s",
                      "run_b/step_0011.safetensors": b"l", "run_c/step_0020/.metadata": b"d",
                      "run_c/step_0020/__0_0.distcp": b"dd", "run_c/step_0021.part/__0_0.distcp": b"s"}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    os.utime(root / "run_a" / "step_0001.pt", ns=(1, 0))  # mtime 0 (some network filesystems): a value like any
    (root / "run_a" / "link.pt").symlink_to(root / "run_a" / "step_0001.pt")
    os.mkfifo(root / "run_b" / "fifo.pt")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "run_b" / "sock.pt"))
    return root


def _here(root: Path, layout: Layout | None, patterns: tuple[str, ...] = ("*.pt",)) -> Snapshot:
    return snapshot_tree(root, patterns, collect_partials=True, layout=layout)


def _start(root: Path, layout: Layout | None = None, command: list[str] | None = None,
           previous: dict[str, object] | None = None) -> PendingListing:
    patterns = ("*.pt",)
    return start_listing(root, patterns, lambda: _here(root, layout), collect_partials=True, exclude=frozenset(),
                         layout=layout, previous=previous or {}, command=command)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [None, "torch", "hf", "dcp"])
def test_a_child_lists_what_a_listing_here_lists(tmp_path: Path, layout: str | None) -> None:
    root = _tree(tmp_path / "root")
    rules = layout_for(layout) if layout else None
    pending = _start(root, rules)
    snap = pending.result()
    assert pending.in_child and pending.problem is None
    here = _here(root, rules)
    assert snap == here  # every field of every record, errors, skipped, staging and look-alikes
    assert snap.files or snap.staging  # the tree has something for every layout
    if rules is None:
        assert set(snap.files) == {"run_a/step_0001.pt", "run_a/step_0002.pt", "run_b/deep/er/step_0010.pt"}
        assert set(snap.partials) == {"run_a/step_0003.pt.part"}
        assert dict(snap.skipped) == {"run_a/link.pt": "symlink", "run_b/fifo.pt": "not a regular file",
                                      "run_b/sock.pt": "not a regular file"}
    if layout == "hf":
        assert set(snap.staging) == {"run_b/checkpoint-8.part"}
    if layout == "dcp":
        assert set(snap.files) == {"run_c/step_0020/.metadata", "run_c/step_0020/__0_0.distcp"}
        assert set(snap.staging) == {"run_c/step_0021.part"}


def test_the_childs_listing_reports_listing_errors_as_a_listing_here_does(tmp_path: Path) -> None:
    """An excluded folder (the other root, through a bind mount) is an error of the listing, not a crash."""
    root = _tree(tmp_path / "root")
    st = (root / "run_b").stat()
    exclude = frozenset({(st.st_dev, st.st_ino)})
    pending = start_listing(root, ("*.pt",), lambda: Snapshot(), collect_partials=True, exclude=exclude,
                            layout=None, previous={})
    snap = pending.result()
    assert pending.in_child
    assert snap == snapshot_tree(root, ("*.pt",), collect_partials=True, exclude=exclude)
    assert len(snap.errors) == 1 and "is the other root" in snap.errors[0] and not snap.complete


def test_unchanged_files_keep_their_records_and_changed_ones_get_new(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root")
    before = _here(root, None)
    (root / "run_a" / "step_0002.pt").write_bytes(b"changed")
    snap = _start(root, previous=dict(before.files)).result()
    assert snap.files["run_a/step_0001.pt"] is before.files["run_a/step_0001.pt"]
    assert snap.files["run_a/step_0002.pt"] is not before.files["run_a/step_0002.pt"]
    assert snap.files["run_a/step_0002.pt"].size == len(b"changed")
    assert snap == _here(root, None)


@pytest.mark.parametrize(("command", "cause"), [
    (["/bin/false"], "exited with status 1"),
    ([sys.executable, "-c", "import sys; sys.stdout.write('not a listing')"], "sent an unreadable listing"),
    ([sys.executable, "-c", "import marshal, sys; sys.stdout.buffer.write(marshal.dumps((1, 2)))"],
     "sent an unreadable listing"),
    ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], "exited with status -9"),
    ([sys.executable, "-c", "raise SystemExit('cannot list: out of memory')"], "cannot list: out of memory"),
    # exit 0, but a listing cut short, or of the wrong shape: never taken for a listing
    ([sys.executable, "-c", "import marshal, sys; sys.stdout.buffer.write(marshal.dumps(([('run/step_1.pt', 1, 2, "
                            "3, 4, 32768, 2)] * 50, [], (), (), [], {}))[:-7])"],
     "sent an unreadable listing (EOFError"),
    ([sys.executable, "-c", "import marshal, sys; sys.stdout.buffer.write(marshal.dumps(([()], [], (), (), [], {})))"],
     "sent an unreadable listing (IndexError"),
    (["/nonexistent/python3"], "could not start /nonexistent/python3"),
])
def test_a_child_that_fails_gives_the_listing_made_here(tmp_path: Path, command: list[str], cause: str) -> None:
    root = _tree(tmp_path / "root")
    pending = _start(root, command=command)
    snap = pending.result()
    assert not pending.in_child
    assert pending.problem is not None and cause in pending.problem
    assert snap == _here(root, None)


def test_an_abandoned_child_is_stopped_and_reaped(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root")
    pending = _start(root, command=[sys.executable, "-c", "import time; time.sleep(600)"])
    child = pending._child
    assert child is not None
    pending.abandon()
    assert child.returncode is not None  # killed and waited for: no zombie, nothing left running


def test_the_child_runs_this_package_not_a_mirrord_folder_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoy = tmp_path / "cwd" / "mirrord"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit('the decoy package was imported')\n")
    monkeypatch.chdir(decoy.parent)
    # As where mirrord is installed: this package already on the child's path, after the working directory
    # an interpreter would put first.
    monkeypatch.setenv("PYTHONPATH", str(Path(mirrord.__file__).parents[1]))
    root = _tree(tmp_path / "root")
    pending = _start(root)
    assert pending.result() == _here(root, None)
    assert pending.in_child, pending.problem


def test_a_volume_lists_in_a_child_only_when_it_is_expected_to_be_big_but_not_huge(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root")
    volume = LocalVolume(root)
    small = volume.start_snapshot(("*.pt",), None, expected_files=CHILD_MIN_FILES - 1)
    first = small.result()
    assert not small.in_child and small.problem is None
    huge = volume.start_snapshot(("*.pt",), None, expected_files=CHILD_MAX_FILES)
    assert huge.result() == first and not huge.in_child and huge.problem is None
    off = volume.start_snapshot(("*.pt",), None, expected_files=CHILD_MIN_FILES, parallel=False)
    assert off.result() == first and not off.in_child and off.problem is None
    big = volume.start_snapshot(("*.pt",), None, expected_files=CHILD_MIN_FILES)
    second = big.result()
    assert big.in_child and big.problem is None
    assert second == first
    # The volume keeps the child's listing as its last one: the next listing here reuses its records.
    third = volume.snapshot(("*.pt",))
    assert all(third.files[rel] is second.files[rel] for rel in third.files)


def test_a_child_of_another_package_refuses_to_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child compares the package it imported (and how it decodes file names) with the request's: a
    listing made by other code could name files differently, so it is refused, and made here."""
    monkeypatch.setattr(listing_child, "_PACKAGE_PARENT", str(tmp_path / "elsewhere"))
    root = _tree(tmp_path / "root")
    pending = _start(root)
    assert pending.result() == _here(root, None)
    assert not pending.in_child
    assert pending.problem is not None and "not the parent's package or file name encoding" in pending.problem


def test_the_child_lists_through_the_interrupts_that_reach_the_whole_group(tmp_path: Path) -> None:
    """A Ctrl-C or a service stop signals every process of the group: the child keeps listing (its parent
    decides, and kills it when the listing is no longer wanted) instead of dying into a re-listing here.
    The child runs the real main(), its listing held at a gate so that the signals surely find it listing."""
    root = _tree(tmp_path / "root")
    listing, gate = tmp_path / "listing", tmp_path / "gate"
    boot = (f"import sys, time; sys.path.insert(0, {str(Path(mirrord.__file__).parents[1])!r}); "
            "import mirrord.store.listing_child as m; real = m.snapshot_tree\n"
            "def held(*args, **kwargs):\n"
            f"    open({str(listing)!r}, 'w').close(); deadline = time.monotonic() + 300\n"
            f"    while not __import__('os').path.exists({str(gate)!r}) and time.monotonic() < deadline:\n"
            "        time.sleep(0.01)\n"
            "    return real(*args, **kwargs)\n"
            "m.snapshot_tree = held; m.main()")
    pending = _start(root, command=[sys.executable, "-P", "-c", boot])
    child = pending._child
    assert child is not None
    wait_for(lambda: listing.exists() or child.poll() is not None, 120, "the child to start listing")
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(child.pid, sig)
    gate.touch()
    assert pending.result() == _here(root, None)
    assert pending.in_child, pending.problem
