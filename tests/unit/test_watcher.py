"""The native watcher against the kernel's inotify: what it asks to be told, and the hints it still gives."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from watchdog.events import EventsLostEvent

from mirrord.config import Config
from mirrord.obs.metrics import Metrics
from mirrord.service.watcher import HANDLED_EVENTS, Hint, PrimaryWatch, Watcher, _Handler
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
        masks += [
            int(word.split(":")[1], 16)
            for line in info.splitlines()
            if line.startswith("inotify wd:")
            for word in line.split()
            if word.startswith("mask:")
        ]
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
    wait_for(
        lambda: (
            Hint("run_b/step_0001.pt", committed=True) in hints and Hint("run_a/step_0002.pt", committed=False) in hints
        ),
        30,
        "hints for both checkpoints",
        context=lambda: repr(hints),
    )


def _deep(top: Path, levels: int) -> Path:
    """top/a/a/.../a, made one level at a time (os.makedirs recurses); returns the deepest folder."""
    top.mkdir()
    deepest = top
    for _ in range(levels):
        deepest = deepest / "a"
        deepest.mkdir()
    return deepest


def test_a_folder_1200_levels_deep_neither_stops_the_start_nor_kills_the_watch(tmp_path: Path) -> None:
    """watchdog walks by path and recursively: with a folder 1,200 levels deep at the start, and another
    moved in later, the watch starts, stays alive and still gives hints."""
    root = tmp_path / "primary"
    (root / "run").mkdir(parents=True)
    _deep(root / "deep", 1200)
    hints: list[Hint] = []
    watcher = Watcher(root, ("*.pt",), "native", 1.0, hints.append)
    watcher.start()
    try:
        _deep(tmp_path / "later", 1200)
        (tmp_path / "later").rename(root / "later")
        (root / "run" / "step_1.pt.tmp").write_bytes(b"x")
        (root / "run" / "step_1.pt.tmp").replace(root / "run" / "step_1.pt")
        wait_for(
            lambda: Hint("run/step_1.pt", committed=True) in hints or not watcher.is_alive(),
            60,
            "the hint for run/step_1.pt",
        )
        assert watcher.is_alive()
    finally:
        watcher.stop()


def test_lost_events_ask_for_a_rescan_once_watchdog_has_rearmed(tmp_path: Path) -> None:
    """An inotify overflow reaches the daemon as watchdog's EventsLostEvent, which watchdog queues only
    after it has re-armed the watches of folders made meanwhile: a rescan asked for then misses nothing.
    (Asked for at the overflow's log record, the rescan could list the tree before those watches existed,
    and the files written into them waited for the periodic rescan: a chaos-test failure under I/O load.)"""
    hints: list[Hint] = []
    handler = _Handler(tmp_path, ("*.pt",), hints.append)
    assert EventsLostEvent in HANDLED_EVENTS  # the observer delivers only the events its filter lists
    handler.on_any_event(EventsLostEvent(str(tmp_path), is_directory=True))
    assert hints == [Hint("", committed=False, rescan=True)]


class _FakeWatcher:
    def __init__(self, mode: str = "native") -> None:
        self.running = False
        self.mode = mode
        self.lost: str | None = None

    def start(self) -> None:
        self.running = True

    def is_alive(self) -> bool:
        return self.running

    def unwatched(self) -> str | None:
        return self.lost

    def stop(self) -> None:
        self.running = False


def test_a_closed_watch_is_neither_reported_dead_nor_started_again(tmp_path: Path) -> None:
    """While the daemon stops, a heartbeat must not take the watcher it stopped for a dead one (an
    'unhealthy' line and a new watcher during shutdown); a watcher that died on its own still is."""
    made: list[_FakeWatcher] = []

    def factory(*_args: object) -> _FakeWatcher:
        made.append(_FakeWatcher())
        return made[-1]

    config = Config(primary=tmp_path, mirror=tmp_path / "m")
    watch = PrimaryWatch(lambda: config, lambda: (1, 1), lambda hint: None, Metrics(), factory=factory)
    watch.start()
    made[-1].stop()  # died on its own
    assert watch.check() == ["filesystem watcher stopped"] and len(made) == 2 and made[-1].running
    watch.close()
    assert watch.check() == [] and len(made) == 2 and not made[-1].running


def test_a_folder_left_unwatched_turns_the_watch_to_polling_for_good(tmp_path: Path) -> None:
    """A native watch that could not watch a new folder (the inotify limit ran out) is replaced, at the next
    heartbeat, by a polling one and a rescan; later re-arms (a recreated root) poll too: the limit that ran
    out once would run out again."""
    made: list[_FakeWatcher] = []
    hints: list[Hint] = []

    def factory(_root: object, _patterns: object, mode: str, *_rest: object) -> _FakeWatcher:
        made.append(_FakeWatcher(mode))
        return made[-1]

    config = Config(primary=tmp_path, mirror=tmp_path / "m")
    key = [(1, 1)]
    watch = PrimaryWatch(lambda: config, lambda: key[0], hints.append, Metrics(), factory=factory)
    watch.start()
    assert made[-1].mode == "native" and watch.check() == [] and len(made) == 1
    made[-1].lost = "cannot watch /primary/run2: No space left on device"
    assert watch.check() == []
    assert [w.mode for w in made] == ["native", "polling"] and not made[0].running and made[1].running
    assert hints == [Hint("", committed=False, rescan=True)]
    assert watch.polling_since is not None and "run2" in watch.polling_since
    key[0] = (1, 2)  # the root recreated: re-armed, still polling
    watch.check()
    assert [w.mode for w in made] == ["native", "polling", "polling"]


# A watcher in a user namespace whose inotify watch limit is 1 (the primary's own watch): the folder made
# after it starts cannot be watched. watchdog's inotify logger is silenced: nothing it logs is read.
UNWATCHABLE = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from mirrord.service.watcher import Watcher
    from tests.support.wait import wait_for

    logging.getLogger("watchdog.observers.inotify").disabled = True
    root = Path(sys.argv[1])
    watcher = Watcher(root, ("*",), "native", 0.1, lambda hint: None)
    watcher.start()
    try:
        assert watcher.unwatched() is None
        (root / "run2").mkdir()
        wait_for(lambda: watcher.unwatched() is not None, 60, "the unwatched folder to be noticed")
        print(watcher.unwatched())
    finally:
        watcher.stop()
""")


def test_a_folder_inotify_cannot_watch_is_found_whatever_watchdog_logs(tmp_path: Path) -> None:
    """The inotify watch limit runs out (for real, in a user namespace of its own) at a folder made under a
    watched primary: Watcher.unwatched() names that folder from the failed inotify_add_watch itself, with
    watchdog's log silenced; a polling watcher never reports one."""
    limited = 'echo 1 > /proc/sys/user/max_inotify_watches && exec "$@"'
    command = ["unshare", "--user", "--map-root-user", "sh", "-c", limited, "sh", sys.executable, "-c", UNWATCHABLE]
    if subprocess.run([*command[:7], "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("needs unshare --user and a per-namespace inotify limit (/proc/sys/user)")
    done = subprocess.run(
        [*command, str(tmp_path)], capture_output=True, text=True, timeout=120, start_new_session=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cannot watch {tmp_path / 'run2'}: inotify watch limit reached"
    polling = Watcher(tmp_path, ("*",), "polling", 0.1, lambda hint: None)
    polling.start()
    try:
        (tmp_path / "run3").mkdir()
        assert polling.unwatched() is None
    finally:
        polling.stop()
