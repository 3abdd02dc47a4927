"""Fixtures shared by every test: temporary roots, real checkpoints, log capture, a thread-leak check."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from mirrord.config import Config
from tests.s3.fixtures import _session_bucket, bucket, prefix, s3_client, s3_env, seaweed  # noqa: F401 (fixtures)
from tests.support import config
from tests.support.checkpoints import save_checkpoint
from tests.support.daemon import DaemonProcess
from tests.support.gate import FuseMount, fuse_unavailable

THREAD_JOIN_SECONDS = 5.0
# Every process the tests start inherits this variable (children copy os.environ, even when they drop
# MIRRORD_*): at the end, a process still carrying this session's value outlived the suite.
SESSION_MARKER = "PYTEST_MIRRORD_SESSION"
LEFTOVER_GRACE_SECONDS = 15.0


def _session_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every live process (not this one, not a zombie) that carries `marker`
    in its environment or is still a child of this process."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z" and (marker.encode() in environ or int(ppid) == me):
            found[int(entry.name)] = cmdline
    return found


def pytest_configure(config: pytest.Config) -> None:
    """A private base temp dir per session (unless --basetemp is given). Under the shared
    /tmp/pytest-of-USER, a concurrent session's cleanup renames and deletes the numbered dirs it deems
    old, a running test's loop mount included (EBUSY, and a warning that fails this suite).

    Under pytest-xdist the controller makes it and each worker gets a folder inside it (--basetemp given).
    The session lock lies beside the folder, not in it: pytest empties a given --basetemp at first use."""
    if config.option.basetemp is None:
        _drop_old_failed_basetemps()
        own = Path(tempfile.mkdtemp(prefix=BASETEMP_PREFIX))
        config.option.basetemp = str(own)
        config.stash[_OWN_BASETEMP] = own
        # Held for the whole session: another session's clean-up never touches a live base temp.
        lock = _lock_path(own).open("w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        config.stash[_OWN_LOCK] = lock


BASETEMP_PREFIX = "mirrord-tests-"
# A failed session keeps its files to look at; only the newest few are kept (each holds up to ~2 GB of
# checkpoints), as pytest itself keeps three numbered base temps.
KEEP_FAILED_BASETEMPS = 3
_OWN_BASETEMP = pytest.StashKey[Path]()
_OWN_LOCK = pytest.StashKey[Any]()


def _lock_path(basetemp: Path) -> Path:
    return basetemp.with_name(basetemp.name + ".lock")


def _drop_old_failed_basetemps() -> None:
    """Delete all but the newest KEEP_FAILED_BASETEMPS base temps left by earlier sessions: only those
    whose session lock can be taken (the session is over) and with nothing mounted below them."""
    locks = sorted(
        Path(tempfile.gettempdir()).glob(BASETEMP_PREFIX + "*.lock"),
        key=lambda f: f.stat().st_mtime if f.exists() else 0.0,
        reverse=True,
    )
    for lock_path in locks[KEEP_FAILED_BASETEMPS:]:
        old = lock_path.with_name(lock_path.name.removesuffix(".lock"))
        try:
            with lock_path.open("r") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not _mounts_below(old):
                    remove_tree(old)
                    lock_path.unlink()
        except OSError:  # a live session holds it, or it is not a file we made
            continue
    # A base temp with no lock beside it was left by a session that never took one (killed between
    # mkdtemp and the lock, or run by older code): dead once it is older than any start-up.
    for old in Path(tempfile.gettempdir()).glob(BASETEMP_PREFIX + "*"):
        try:
            orphan = old.is_dir() and not _lock_path(old).exists() and time.time() - old.stat().st_mtime > 600
        except OSError:
            continue
        if orphan and not _mounts_below(old):
            remove_tree(old)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A session that passed leaves nothing in /tmp; a failed one keeps its files to look at."""
    own = session.config.stash.get(_OWN_BASETEMP, None)
    if own is not None and exitstatus == 0 and not _mounts_below(own):
        remove_tree(own)
        _lock_path(own).unlink(missing_ok=True)


def remove_tree(root: Path) -> None:
    """rm -rf, which walks without recursion: the tests build trees deeper than Python's recursion limit
    (shutil.rmtree raises RecursionError on them, which ignore_errors does not cover)."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(root)], capture_output=True, check=False)


def _mounts_below(root: Path) -> list[str]:
    """Mount points inside root, from the kernel's table: walking the tree and stat'ing each directory
    fails on the deeper-than-PATH_MAX tree a prune test builds on purpose (ENAMETOOLONG)."""
    inside = f"{root}/"
    with Path("/proc/self/mounts").open() as mounts:
        return [point for point in (line.split()[1] for line in mounts) if point.startswith(inside)]


# Tiers: each test is marked by the folder it lives in, and by what it needs.
FOLDER_MARKERS = ("unit", "integration", "chaos", "s3", "deploy")
# Fixtures that mount a filesystem (tmpfs, ext4 on a loop device, FUSE): a test using one touches the host.
HOST_FIXTURES = frozenset({"small_tmpfs", "loop_fs", "gated_primary", "fuse_world"})
# A FUSE passthrough in the test's own folder is seen by no other test: the tests whose only mount it is run
# one after another in a group of their own, beside the `host` group rather than adding to its length.
FUSE_FIXTURES = frozenset({"gated_primary", "fuse_world"})
GROUP_HOST, GROUP_FUSE = "host", "fuse"
TESTS = Path(__file__).parent
# The trainer scripts a test runs by module name (tests/support/train_*.py): they import a trainer library.
TRAINER_SCRIPTS = tuple(f.stem for f in (TESTS / "support").glob("train_*.py"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads xdist_group to form the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by its folder (unit, integration, chaos, s3, deploy), `s3` when it uses the SeaweedFS
    server, `trainers` when its module runs a trainer script, and `host` when it changes the host (a mount,
    a sysctl, a container): host tests share one pytest-xdist group, so they run one after another; those
    whose only mount is a FUSE passthrough of their own share the `fuse` group instead."""
    needs_trainer: dict[Path, bool] = {}
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        if folder in FOLDER_MARKERS:
            item.add_marker(folder)
        fixtures = set(getattr(item, "fixturenames", ()))
        if "seaweed" in fixtures:
            item.add_marker("s3")
        if item.path not in needs_trainer:
            source = item.path.read_text(encoding="utf-8")
            needs_trainer[item.path] = any(f'"{name}"' in source for name in TRAINER_SCRIPTS)
        if needs_trainer[item.path]:
            item.add_marker("trainers")
        marked_host = item.get_closest_marker("host") is not None
        mounts = fixtures & HOST_FIXTURES
        if folder == "deploy" or mounts:
            item.add_marker("host")
        if item.get_closest_marker("host") is not None:
            own_fuse = folder != "deploy" and not marked_host and mounts <= FUSE_FIXTURES
            item.add_marker(pytest.mark.xdist_group(GROUP_FUSE if own_fuse else GROUP_HOST))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, every host test must carry its group in its id (pytest-xdist renames it so):
    a pytest that keeps ids as they were would spread them over the workers, each building the deploy
    images again and mounting beside the others. Fail loudly instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    groups = (f"@{GROUP_HOST}", f"@{GROUP_FUSE}")
    lost = [
        item.nodeid for item in session.items if item.get_closest_marker("host") and not item.nodeid.endswith(groups)
    ]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist could not group {len(lost)} host tests (first: {lost[0]}); "
            "this pytest and pytest-xdist do not work together: see pyproject.toml"
        )


# Folders tests make outside the base temp (world_tmp): each must be gone by the end of the session.
_OUTSIDE_FOLDERS: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """Fail the session if a process started by the tests outlives them (then kill it), or a folder a test
    made outside the base temp is still there (then delete it): a test must stop what it starts, by process
    group, and remove what it makes, pass or fail. Under pytest-xdist each worker checks its own."""
    marker = f"{SESSION_MARKER}={os.getpid()}-{time.time_ns()}"
    os.environ[SESSION_MARKER] = marker.split("=", 1)[1]
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while (left := _session_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a process that is already exiting gets a bounded grace period
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os.environ.pop(SESSION_MARKER, None)
    folders = [path for path in _OUTSIDE_FOLDERS if path.exists()]
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)
    problems = []
    if left:
        listing = "\n  ".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items()))
        problems.append(f"{len(left)} process(es) started by the tests outlived the suite (now killed):\n  {listing}")
    if folders:
        listing = "\n  ".join(map(str, folders))
        problems.append(f"{len(folders)} folder(s) made by the tests outlived them (now deleted):\n  {listing}")
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread running: every worker a test starts must be joined by it.

    A thread that is already finishing gets a bounded join before it counts as leaked.
    """
    before = set(threading.enumerate())
    yield
    new = [t for t in threading.enumerate() if t not in before]
    deadline = time.monotonic() + THREAD_JOIN_SECONDS
    for thread in new:
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = [t.name for t in new if t.is_alive()]
    if leaked:
        pytest.fail(f"test leaked threads: {leaked}")


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """cli.main() configures structlog onto the stream pytest captured; never let that outlive a test."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    """Log events emitted during the test, as dicts (structlog.testing.capture_logs)."""
    with structlog.testing.capture_logs() as captured:
        yield captured


@pytest.fixture
def primary(tmp_path: Path) -> Path:
    path = tmp_path / "primary"
    path.mkdir()
    return path


@pytest.fixture
def mirror(tmp_path: Path) -> Path:
    path = tmp_path / "mirror"
    path.mkdir()
    return path


@pytest.fixture
def make_config(primary: Path, mirror: Path) -> Callable[..., Config]:
    """A Config for the test's roots, with no file and no environment; sections as keyword dicts."""

    def make(**overrides: Any) -> Config:
        return config.load(config.settings(primary, mirror, config.UNIT, overrides))

    return make


@pytest.fixture
def checkpoint() -> Callable[..., Path]:
    """save_checkpoint(path, step, width=64, depth=2, mtime_ns=None): a real torch.save file."""
    return save_checkpoint


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Make daemons on tmp_path/primary -> tmp_path/mirror; every one is killed at teardown."""
    made: list[DaemonProcess] = []
    (tmp_path / "primary").mkdir(exist_ok=True)

    def make(settings: dict[str, Any] | None = None, **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path, tmp_path / "primary", tmp_path / "mirror", settings, **kwargs)
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill()


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A directory an unprivileged child can reach (pytest's own tmp dirs are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="mirrord-test-", dir="/tmp"))
    _OUTSIDE_FOLDERS.append(path)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs: free space is small and exact, ENOSPC is the kernel's own."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True, check=True)


@pytest.fixture
def gated_primary(tmp_path: Path) -> Iterator[FuseMount]:
    """tmp_path/primary (where daemon_factory's daemons read) served from tmp_path/backing through a FUSE
    passthrough with a gate: write checkpoints into `.backing`; `.stall(name, ...)` holds every copy of those
    files in flight until `.unstall()`. No inotify event crosses it: a daemon finds files by scanning."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(f"needs a FUSE mount: {reason}")
    mount = FuseMount(tmp_path / "backing", tmp_path / "primary", tmp_path)
    try:
        yield mount
    finally:
        mount.close()
