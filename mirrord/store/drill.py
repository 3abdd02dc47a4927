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

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mirrord.errors import DamagedCopyError
from mirrord.store.restore import restore

if TYPE_CHECKING:
    from mirrord.layouts import Layout
    from mirrord.store.mirror import ReadableStore
    from mirrord.store.resume import Candidate

LOAD_SECONDS = 1800  # wall clock and CPU time of one unit's load
LOAD_MEMORY_BYTES = 16 * 2**30  # address space beside the unit's own size (mmap maps it, torch's libraries)


def drill(
    store: ReadableStore, layout: Layout, run: str | None, loads: bool, units: list[Candidate], within: str = ""
) -> dict[str, Any]:
    """Restore `run`'s newest verified unit into a scratch folder (in the folder `within` of a local mirror's
    root, made if missing) and load it with the reader of the layout its record names (else the config's); what
    happened, as --json says it. No unit of `run`: restore says why."""
    local = store.local_tree()
    mirror_side = local.root / within if local is not None and os.access(local.root, os.W_OK) else None
    if mirror_side is not None:
        mirror_side.mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".mirrord-drill-", dir=mirror_side))
    found: dict[str, Any] = {"run": run or ".", "loaded": [], "file": None, "error": None}
    try:
        done = restore(store, scratch, layout, run)
        found |= {"path": store.describe(done.key), "relative_path": done.key, "step": done.step}
        if done.damaged:  # the newest unit could not be brought back: that is the drill's finding
            raise done.damaged[0]
        reader = (units[0].entries[0].layout if units else "") or layout.name  # (units[0] damaged: failed above)
        verdict = _load(scratch, done.key, reader, done.size) if loads else {}
        return found | verdict | ({"file": store.describe(verdict["file"])} if "file" in verdict else {})
    except DamagedCopyError as exc:
        return found | {"file": exc.path, "error": exc.cause}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load(scratch: Path, key: str, layout: str, size: int) -> dict[str, Any]:
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
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=LOAD_SECONDS, check=False, **drop)
        except subprocess.TimeoutExpired:
            return {"file": key, "error": f"the loader did not finish in {LOAD_SECONDS} s"}
        except OSError:
            if not drop:
                raise
            continue  # nobody cannot run this interpreter
        if done.stdout.startswith("{"):  # else nobody could not read the copy, or the loader was killed
            return dict(json.loads(done.stdout))
    return {"file": key, "error": f"the loader exited {done.returncode}: {done.stderr.strip()[-2000:]}"}
