"""A drill: prove a run's newest checkpoint can be brought back and loaded, before the day it is needed
(`mirrord drill`, and the daemon after each newest unit is verified, mirrord.service.drills).

    mirrord.store.restore (every byte checked against the record) -> a scratch folder on the mirror's side ->
    mirrord.formats.loader in its own process (time, CPU and memory bounded; as root: as nobody where it can)
    -> the scratch folder deleted, whatever happened

The scratch folder is a hidden folder in a local mirror's root (scans never enter it, and it is on the
mirror's disk, never the primary's); for a mirror this user cannot write (read-only) or S3, one in the
system temp dir. This process never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from subprocess import PIPE
from typing import TYPE_CHECKING, Any

from mirrord.errors import DamagedCopyError
from mirrord.store.restore import restore

if TYPE_CHECKING:
    from mirrord.layouts import Layout
    from mirrord.store.mirror import ReadableStore
    from mirrord.store.resume import Candidate

LOAD_SECONDS = 1800  # wall clock and CPU time of one unit's load
LOAD_MEMORY_BYTES = 16 * 2**30  # address space beside the unit's own size (mmap maps it, torch's libraries)


class StoppedError(Exception):
    """The drill was stopped (Halt.stop): it found nothing, and left nothing behind."""


class Halt:
    """Stops a drill from another thread (the daemon stopping): its restore at its next read, its loader and
    anything the loader started at once (their process group, SIGKILL), not after the loader's time bound."""

    def __init__(self) -> None:
        self.stopped, self._loader, self._lock = False, 0, threading.Lock()

    def stop(self) -> None:
        """For good: the drill under way ends, and so does any later one at its start."""
        with self._lock:
            self.stopped = True
            self._kill()

    def loader(self, pid: int) -> None:
        """The loader started (its pid, its group's id), or is reaped (0: its pid may be another's soon)."""
        with self._lock:
            self._loader = pid
            self._kill()

    def _kill(self) -> None:
        if self.stopped and self._loader:
            with contextlib.suppress(ProcessLookupError):  # (it exited meanwhile)
                os.killpg(self._loader, signal.SIGKILL)

    def check(self, *_progress: object) -> None:
        """Raise StoppedError once stopped (restore's progress callback)."""
        if self.stopped:
            raise StoppedError


def drill(
    store: ReadableStore,
    layout: Layout,
    run: str | None,
    loads: bool,
    units: list[Candidate],
    within: str = "",
    halt: Halt | None = None,
) -> dict[str, Any]:
    """Restore `run`'s newest verified unit into a scratch folder (in the folder `within` of a local mirror's
    root, made if missing) and load it with the reader of the layout its record names (else the config's); what
    happened, as --json says it. No unit of `run`: restore says why. StoppedError once `halt` is stopped."""
    halt = halt or Halt()
    local = store.local_tree()
    mirror_side = local.root / within if local is not None and os.access(local.root, os.W_OK) else None
    if mirror_side is not None:
        mirror_side.mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".mirrord-drill-", dir=mirror_side))
    found: dict[str, Any] = {"run": run or ".", "loaded": [], "file": None, "error": None}
    try:
        done = restore(store, scratch, layout, run, progress=halt.check)
        found |= {"path": store.describe(done.key), "relative_path": done.key, "step": done.step}
        if done.damaged:  # the newest unit could not be brought back: that is the drill's finding
            raise done.damaged[0]
        reader = (units[0].entries[0].layout if units else "") or layout.name  # (units[0] damaged: failed above)
        verdict = _load(scratch, done.key, reader, done.size, halt) if loads else {}
        return found | verdict | ({"file": store.describe(verdict["file"])} if "file" in verdict else {})
    except DamagedCopyError as exc:
        return found | {"file": exc.path, "error": exc.cause}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load(scratch: Path, key: str, layout: str, size: int, halt: Halt) -> dict[str, Any]:
    """mirrord.formats.loader's verdict on scratch/key: as root, first as nobody (handed the scratch copy)."""
    import pwd

    drops: list[dict[str, Any]] = [{}]
    if os.geteuid() == 0 and (nobody := {u.pw_name: u for u in pwd.getpwall()}.get("nobody")):
        for path in (scratch, *scratch.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)
        drops.insert(0, {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []})
    for drop in drops:
        # -P: the loader imports no module from the working directory (a torch.py where the drill was run)
        # The loader bounds itself (memory, CPU): no preexec_fn, which can deadlock a child of the threaded daemon.
        bounds = [str(LOAD_MEMORY_BYTES + size), str(LOAD_SECONDS)]
        argv = [sys.executable, "-P", "-m", "mirrord.formats.loader", layout, str(scratch), key, *bounds]
        # A group of its own, killed whole (whatever the loader started) on a timeout, Ctrl-C, SIGTERM or a halt.
        try:
            done = subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, text=True, process_group=0, **drop)
        except OSError:
            if not drop:
                raise
            continue  # nobody cannot run this interpreter
        halt.loader(done.pid)
        try:
            out, err = done.communicate(timeout=LOAD_SECONDS)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(done.pid, signal.SIGKILL)
            done.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            return {"file": key, "error": f"the loader did not finish in {LOAD_SECONDS} s"}
        finally:
            halt.loader(0)
        halt.check()  # killed by the halt: no verdict
        if out.startswith("{"):  # else nobody could not read the copy, or the loader was killed
            return dict(json.loads(out))
    return {"file": key, "error": f"the loader exited {done.returncode}: {err.strip()[-2000:]}"}
