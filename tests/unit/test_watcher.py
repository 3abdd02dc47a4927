"""The native watcher against the kernel's inotify: what it asks to be told, and the hints it still gives."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mirrord.service.watcher import Hint, Watcher
from tests.support.wait import wait_for

IN_CLOSE_WRITE, IN_CLOSE_NOWRITE, IN_OPEN = 0x08, 0x10, 0x20
IN_MOVED_TO, IN_CREATE, IN_MODIFY, IN_ATTRIB = 0x80, 0x100, 0x02, 0x04


def inotify_masks() -> list[int]:
    """The mask of every inotify watch this process holds, from /proc/self/fdinfo."""
    masks = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if str(fd.readlink()) != "anon_inode:inotify":
                continue
            info = Path("/proc/self/fdinfo", fd.name).read_text()
        except OSError:
            continue  # (the listing's own descriptor, or one closed meanwhile)
        masks += [int(word.split(":")[1], 16) for line in info.splitlines() if line.startswith("inotify wd:")
                  for word in line.split() if word.startswith("mask:")]
    return masks


@pytest.fixture
def watching(tmp_path: Path) -> Iterator[tuple[Path, list[Hint]]]:
    root = tmp_path / "primary"
    (root / "run_a").mkdir(parents=True)
    hints: list[Hint] = []
    lock = threading.Lock()

    def emit(hint: Hint) -> None:
        with lock:
            hints.append(hint)

    watcher = Watcher(root, ("*.pt",), "native", 1.0, emit)
    watcher.start()
    try:
        yield root, hints
    finally:
        watcher.stop()


def test_opens_and_reads_below_the_primary_are_not_events(watching: tuple[Path, list[Hint]]) -> None:
    """A rescan opens and closes every folder of the primary, a copy opens every checkpoint it reads:
    the watches leave those out of the kernel's queue (each would be parsed by the watch thread), and keep
    what the hints come from."""
    root, _ = watching
    (root / "run_b").mkdir()  # a folder made after the start is watched with the same mask
    wait_for(lambda: len(inotify_masks()) >= 3, 30, "a watch on each of the three folders")
    masks = inotify_masks()
    assert all(m & (IN_OPEN | IN_CLOSE_NOWRITE) == 0 for m in masks), [hex(m) for m in masks]
    want = IN_MOVED_TO | IN_CLOSE_WRITE | IN_CREATE | IN_MODIFY | IN_ATTRIB
    assert all(m & want == want for m in masks), [hex(m) for m in masks]


def test_a_rename_and_a_close_after_writing_are_still_hints(watching: tuple[Path, list[Hint]]) -> None:
    root, hints = watching
    (root / "run_b").mkdir()
    wait_for(lambda: len(inotify_masks()) >= 3, 30, "a watch on the new folder")
    tmp = root / "run_b" / "step_0001.pt.tmp"
    tmp.write_bytes(b"x" * 1000)
    tmp.replace(root / "run_b" / "step_0001.pt")
    with (root / "run_a" / "step_0002.pt").open("wb") as f:  # written in place
        f.write(b"y" * 1000)
    for _ in range(3):  # opened and read, as a copy does: no hint
        (root / "run_a" / "step_0002.pt").read_bytes()
    wait_for(lambda: Hint("run_b/step_0001.pt", committed=True) in hints
             and Hint("run_a/step_0002.pt", committed=False) in hints, 30, "hints for both checkpoints",
             context=lambda: repr(hints))
