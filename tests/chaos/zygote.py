"""A fork server for the chaos tests: import mirrord once, then fork one real `mirrord` process per request.

Interpreter start-up and imports take far longer than copying a few small checkpoints; with a fresh
exec per round almost every random SIGKILL would land in the import phase. A forked child is a real
process running the real `mirrord.cli.main` - it only skips start-up - so kills land in the copy,
the rename, the manifest write or the prune.

Requests are JSON lines on stdin, answers JSON lines on stdout:
    {"op": "spawn", "argv": [...], "log": FILE, "stdout": FILE?, "env": {...}, "stop": bool, "patch": NAME?}
        -> {"pid": N}   (with "stop", the child SIGSTOPs itself first, so a tracer can attach)
    {"op": "wait", "pid": N, "timeout": SECONDS} -> {"status": exit code, -signal, or null on timeout}
On EOF every child still running is killed and reaped.

`patch` names a deliberately broken durability protocol (to prove the tests can fail) or a hook that
changes the world at an exact point inside the copy; see PATCHES.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mirrord.cli
import mirrord.commands.latest
import mirrord.commands.sync
import mirrord.commands.verify
import mirrord.service.copier
import mirrord.service.daemon
import mirrord.service.pruner
import mirrord.store.journal
import mirrord.store.manifest
import mirrord.store.resume
from mirrord import paths
from mirrord.store import atomic, upload, volume

_real_fsync = os.fsync


class _SelectiveFsync:
    """Stands in for the `os` module inside mirrord's durability code, dropping some fsync calls."""

    def __init__(self, skip: Callable[[int], bool]) -> None:
        self._skip = skip

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        if not self._skip(fd):
            _real_fsync(fd)


def _is_dir(fd: int) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def _is_file(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _use_fsync(skip: Callable[[int], bool]) -> None:
    proxy = _SelectiveFsync(skip)
    for module in (atomic, upload, volume, paths):
        module.os = proxy  # type: ignore[assignment]


def _broken_no_dir_fsync(arg: str) -> None:
    """Publish without fsyncing the directory: the rename may not survive a power cut."""
    _use_fsync(_is_dir)
    atomic._syncfs = None  # a group's syncfs would cover its directories


def _no_file_flush() -> None:
    """No fsync of files, and no write-behind or syncfs either (they would put the data on disk early
    anyway)."""
    _use_fsync(_is_file)
    atomic._syncfs = None
    if hasattr(upload, "_sync_file_range"):
        upload._sync_file_range = None


def _broken_no_file_fsync(arg: str) -> None:
    """Rename data that was never fsynced: a power cut can leave the final name on an empty file."""
    _no_file_flush()


def _broken_rename_before_fsync(arg: str) -> None:
    """Rename first, fsync afterwards: for a moment the final name points at data not yet on disk."""
    _no_file_flush()

    def publish(dir_fd: int, final_name: str, temp_fd: int, dirs: atomic.DirSyncs | None = None) -> None:
        os.replace(atomic.temp_name(final_name), final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        _real_fsync(temp_fd)
        _real_fsync(dir_fd)

    atomic.publish = publish  # type: ignore[assignment]


def _broken_journal_no_fsync(arg: str) -> None:
    """Journal records written but never fsynced: a change "counts" before it is durable."""

    class _JournalAtomic:  # the journal's view of mirrord.store.atomic: its fsyncs of records dropped
        def __getattr__(self, name: str) -> Any:
            return getattr(atomic, name)

        sync = _SelectiveFsync(_is_file).fsync

    mirrord.store.journal.atomic = _JournalAtomic()  # type: ignore[attr-defined]


def _broken_record_before_dir_fsync(arg: str) -> None:
    """Group commit with its last two steps swapped: the journal record of a group of copies is written
    and fsynced before the fsync of the directories their renames were made in."""
    real_flush, real_apply = atomic.DirSyncs.flush, mirrord.store.manifest.Manifest.apply
    held: list[atomic.DirSyncs] = []

    def flush(self: atomic.DirSyncs) -> None:
        self._publish_files()  # the files' fsyncs and renames, as the real flush() makes them first
        taken = atomic.DirSyncs()
        taken.absorb(self)
        held.append(taken)

    def apply(self: Any, puts: Any = (), removes: Any = ()) -> None:
        try:
            real_apply(self, puts, removes)
        finally:
            while held:
                real_flush(held.pop())

    atomic.DirSyncs.flush = flush  # type: ignore[method-assign]
    mirrord.store.manifest.Manifest.apply = apply  # type: ignore[method-assign]


def _broken_late_removal(arg: str) -> None:
    """A prune's manifest removals recorded one batch late: files are unlinked while still recorded."""
    real_apply, real_close = mirrord.store.manifest.Manifest.apply, mirrord.store.manifest.Manifest.close
    deferred: list[str] = []

    def apply(self: Any, puts: Any = (), removes: Any = ()) -> None:
        puts, removes = tuple(puts), tuple(removes)
        if removes and not puts:
            late, deferred[:] = list(deferred), removes
            if late:
                real_apply(self, removes=late)
            return
        real_apply(self, puts, removes)

    def close(self: Any) -> None:
        if deferred:
            real_apply(self, removes=list(deferred))
        real_close(self)

    mirrord.store.manifest.Manifest.apply = apply  # type: ignore[method-assign]
    mirrord.store.manifest.Manifest.close = close  # type: ignore[method-assign]


def _swap_source(make: Callable[[Path], None]) -> Callable[[str], None]:
    """Replace the source file ARG just before the copier opens it (the scan saw a regular file)."""

    def install(arg: str) -> None:
        real_open = mirrord.service.copier.open_file_beneath
        done: list[bool] = []

        def open_file_beneath(root: Path, rel: str, flags: int = os.O_RDONLY) -> int:
            if rel == arg and not done:
                done.append(True)
                path = Path(root) / rel
                path.unlink()
                make(path)
            return real_open(root, rel, flags)

        mirrord.service.copier.open_file_beneath = open_file_beneath  # type: ignore[assignment]

    return install


PATCHES: dict[str, Callable[[str], None]] = {
    "no_dir_fsync": _broken_no_dir_fsync,
    "no_file_fsync": _broken_no_file_fsync,
    "rename_before_fsync": _broken_rename_before_fsync,
    "journal_no_fsync": _broken_journal_no_fsync,
    "late_removal": _broken_late_removal,
    "record_before_dir_fsync": _broken_record_before_dir_fsync,
    "fifo_at_open": _swap_source(lambda p: os.mkfifo(p, 0o644)),
    "zero_device_at_open": _swap_source(lambda p: os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 5))),
    "symlink_at_open": _swap_source(lambda p: p.symlink_to(os.environ["CHAOS_SYMLINK_TARGET"])),
}


def _child(req: dict[str, Any], reply_fd: int) -> None:
    code = 70
    try:
        os.close(reply_fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        log_fd = os.open(req["log"], flags, 0o644)
        out_fd = os.open(req.get("stdout") or req["log"], flags, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(log_fd, 2)
        for name in [n for n in os.environ if n.startswith("MIRRORD_")]:
            del os.environ[name]
        os.environ.update(req.get("env") or {})
        patch = req.get("patch")
        if patch:
            name, _, arg = patch.partition(":")
            PATCHES[name](arg)
        if req.get("stop"):
            os.kill(os.getpid(), signal.SIGSTOP)
        code = mirrord.cli.main(req["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting anyway: a lost flush changes nothing
                stream.flush()
        os._exit(code)


def _wait(pid: int, timeout: float, children: set[int], reaped: dict[int, int]) -> int | None:
    """The child's exit code (-signal if killed), or None if it still runs after `timeout` seconds."""
    if pid in reaped:
        return reaped[pid]
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            reaped[pid] = os.waitstatus_to_exitcode(status)
            return reaped[pid]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def main() -> None:
    reply_fd = os.dup(1)
    children: set[int] = set()
    reaped: dict[int, int] = {}

    def reply(obj: dict[str, Any]) -> None:
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(reply_fd, data) :]

    try:
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    _child(req, reply_fd)
                children.add(pid)
                # The kernel reuses pids (pid_max is 32768 here, and a full suite on a shared machine wraps
                # it): an exit status kept for an earlier child of this pid belongs to that child. Left in
                # place, `wait` would answer at once for this one while it still runs.
                reaped.pop(pid, None)
                reply({"pid": pid})
            elif req["op"] == "wait":
                pid = int(req["pid"])
                reply({"status": _wait(pid, float(req.get("timeout", 60)), children, reaped)})
            else:
                reply({"error": f"unknown op {req['op']!r}"})
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
