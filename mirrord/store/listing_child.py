"""A volume listed by a child process while this one lists the other: a reconcile's two listings on two CPUs.

A listing is CPU-bound Python (one lstat and one record per file, ~10 µs a file): in two threads the
listings of the primary and of the mirror take turns on the interpreter lock, in two processes they run
at once. The child is a fresh interpreter running this module's `main`, never a fork of a daemon that
runs threads; it lists with the same code (mirrord.store.scan.snapshot_tree) and sends the
snapshot back as plain values (marshal), from which this process makes the records.

The child is an optimisation only. One that cannot start, fails or sends back anything unreadable is
not an error: the listing is then made in this process, as it would have been, and `problem` says why.
Below CHILD_MIN_FILES expected files the listing is made here (starting an interpreter costs ~0.1 s), and
from CHILD_MAX_FILES on too (the listing would be held twice while it is sent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import marshal
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mirrord.core.layouts import Layout
from mirrord.core.model import FileState, Snapshot
from mirrord.store.bulk import collection_paused
from mirrord.store.scan import snapshot_tree

if TYPE_CHECKING:
    import subprocess  # imported when a child is started: `mirrord latest` never starts one

# Files a volume is expected to hold (the manifest's entries, or its last listing) from which its listing is
# made in a child: about where the child's start and the transfer (~0.15 s) cost less than listing here...
CHILD_MIN_FILES = 20_000
# ... and up to which: the child holds a second copy of the listing while it sends it, and this process the
# sent values beside the records it makes (at 1,000,000 files 746 MiB in the child and 1,048 MiB here,
# against 904 MiB for the listing here: past the 1 GB a reconcile may take).
CHILD_MAX_FILES = 250_000
# The child imports this very package: its folder is put first on the child's path unless already on it, and
# the working directory is not put there at all (-P: a `mirrord` folder in it must not be what runs). The
# request names the folder, and the child refuses to list if the package it imported is another one.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_BOOT = (f"import sys; p = {_PACKAGE_PARENT!r}; p in sys.path or sys.path.insert(0, p); "
         "from mirrord.store.listing_child import main; main()")

Listing = Callable[[], Snapshot]


class PendingListing:
    """A listing begun (in a child, or not at all yet) and taken by `result()`, which makes it here if the
    child did not."""

    def __init__(self, list_here: Listing, child: subprocess.Popen[bytes] | None = None,
                 previous: Mapping[str, FileState] | None = None, problem: str | None = None,
                 taken: Callable[[Snapshot], None] | None = None) -> None:
        self._list_here = list_here
        self._child = child
        self._previous = previous or {}
        self._taken = taken  # told of the child's snapshot (a volume keeps its last listing)
        self.problem = problem  # why a child was asked for and not used (None: used, or not asked for)
        self.in_child = False  # whether the result came from the child

    def result(self) -> Snapshot:
        """The snapshot: the child's, else a listing made now in this process."""
        child, self._child = self._child, None
        if child is not None:
            try:
                out, err = child.communicate()
            except OSError as exc:
                self.problem = f"reading its listing failed: {exc.strerror or exc}"
            except BaseException:  # (a KeyboardInterrupt while waiting): the child goes too
                _stop(child)
                raise
            else:
                if child.returncode != 0:
                    last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
                    self.problem = f"exited with status {child.returncode}: {last[0]}"
                else:
                    try:
                        with collection_paused():  # (a heap of new records, none in a cycle)
                            snap = _from_values(marshal.loads(out), self._previous)  # noqa: S302 - our child, a pipe of ours
                    except Exception as exc:  # anything but a whole listing of the expected shape
                        self.problem = f"sent an unreadable listing ({type(exc).__name__}: {exc})"
                    else:
                        self.in_child = True
                        if self._taken is not None:
                            self._taken(snap)
                        return snap
        return self._list_here()

    def abandon(self) -> None:
        """Stop a child whose listing is no longer wanted (the caller failed before taking it)."""
        child, self._child = self._child, None
        if child is not None:
            _stop(child)


def _stop(child: subprocess.Popen[bytes]) -> None:
    """Kill the child and reap it (no zombie, nothing left listing)."""
    child.kill()
    child.communicate()


def start_listing(root: Path, patterns: Sequence[str], list_here: Listing, *, collect_partials: bool,
                  exclude: frozenset[tuple[int, int]], layout: Layout | None,
                  previous: Mapping[str, FileState], taken: Callable[[Snapshot], None] | None = None,
                  command: Sequence[str] | None = None) -> PendingListing:
    """Begin listing `root` as snapshot_tree(root, patterns, collect_partials, exclude, layout) would, in a
    child process (`command`: the interpreter and module to run, for tests). `list_here` is the same
    listing made in this process, the fallback; `previous` the records a listing here would reuse; `taken` is
    called with the child's snapshot when it is taken."""
    import subprocess

    # What the child must share with this process to list as it would: the package, and how names on disk
    # decode (the interpreter's flags are passed on, -X utf8 among them; the child checks the result).
    request = marshal.dumps((_PACKAGE_PARENT, sys.getfilesystemencoding(), sys.getfilesystemencodeerrors(),
                             str(root), tuple(patterns), collect_partials, tuple(exclude), _layout_fields(layout)))
    if command is None:
        if not sys.executable:
            return PendingListing(list_here, problem="no interpreter to start (sys.executable is empty)")
        # (the flags as multiprocessing passes them to its children)
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        command = (sys.executable, *flags, "-P", "-c", _BOOT)
    try:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        return PendingListing(list_here, problem=f"could not start {command[0]}: {exc.strerror or exc}")
    stdin, child.stdin = child.stdin, None  # sent here, not by communicate() (which waits for the answer)
    assert stdin is not None
    with contextlib.suppress(OSError):  # the child is already gone: communicate() tells how
        stdin.write(request)  # a few hundred bytes: never blocks on the pipe
    with contextlib.suppress(OSError):
        stdin.close()
    return PendingListing(list_here, child, previous, taken=taken)


def _layout_fields(layout: Layout | None) -> dict[str, Any] | None:
    if layout is None:
        return None
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.init}


def _to_values(snap: Snapshot) -> tuple[Any, ...]:
    """The snapshot as values marshal can send: each record as a tuple of its fields. (marshal keeps what
    the records share: an interned name arrives interned, one int object for many records stays one.)"""
    def rows(states: Mapping[str, FileState]) -> list[tuple[Any, ...]]:
        return [(s.rel, s.size, s.mtime_ns, s.ino, s.dev, s.mode, s.ctime_ns) for s in states.values()]
    return (rows(snap.files), rows(snap.partials), snap.errors, snap.skipped, rows(snap.staging),
            snap.lookalikes)


def _from_values(values: tuple[Any, ...], previous: Mapping[str, FileState]) -> Snapshot:
    """The snapshot _to_values sent; a file whose values equal its record in `previous` keeps that record."""
    files_rows, partial_rows, errors, skipped, staging_rows, lookalikes = values
    recorded = previous.get
    make = FileState

    def states(rows: list[tuple[Any, ...]]) -> dict[str, FileState]:
        if not previous:
            return {row[0]: make(*row) for row in rows}
        out: dict[str, FileState] = {}
        for row in rows:
            rel, size, mtime, ino, dev, mode, ctime = row
            state = recorded(rel)
            if state is None or state.mtime_ns != mtime or state.ctime_ns != ctime or state.ino != ino \
                    or state.size != size or state.dev != dev or state.mode != mode:
                state = make(*row)
            out[state.rel] = state
        return out

    return Snapshot(states(files_rows), states(partial_rows), tuple(errors), tuple(tuple(s) for s in skipped),
                    states(staging_rows), dict(lookalikes))


def main() -> None:
    """The child: read the request from stdin, list, write the snapshot's values to stdout. Interrupts are
    the parent's to act on (it kills the child when it no longer wants the listing): a Ctrl-C or a
    service stop that reaches the whole group must not make the parent list the volume again itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    request = sys.stdin.buffer.read()
    package, encoding, errors, root, patterns, collect_partials, exclude, layout_fields = marshal.loads(request)  # noqa: S302
    if (_PACKAGE_PARENT, sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()) != (package, encoding, errors):
        raise SystemExit(f"not the parent's package or file name encoding: {_PACKAGE_PARENT} "
                         f"{sys.getfilesystemencoding()}/{sys.getfilesystemencodeerrors()}, asked for {package} "
                         f"{encoding}/{errors}")
    layout = Layout(**layout_fields) if layout_fields is not None else None
    with collection_paused():
        snap = snapshot_tree(Path(root), patterns, collect_partials=collect_partials,
                             exclude=frozenset(tuple(e) for e in exclude), layout=layout)
        out = memoryview(marshal.dumps(_to_values(snap)))
    while out:  # os.write may write less than asked (a pipe, a signal)
        out = out[os.write(1, out):]
