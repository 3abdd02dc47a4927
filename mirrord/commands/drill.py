"""`mirrord drill`: prove each run's newest checkpoint can be brought back and loaded, before the day it is needed.

    mirrord.store.restore (every byte checked against the record) -> a scratch folder on the mirror's side ->
    mirrord.formats.loader in its own process (time, CPU and memory bounded; as root: as nobody where it can)
    -> the scratch folder deleted, whatever happened

The scratch folder is a hidden `.mirrord-drill-*` folder in a local mirror's root (scans never enter it, and
it is on the mirror's disk, never the primary's); for a mirror this user cannot write (read-only) or S3, one
in the system temp dir. This process never imports torch; without torch the drill checks the bytes and the
structure the record vouches for, and says it loaded nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mirrord.commands.latest import opened_run
from mirrord.commands.printable import printable
from mirrord.errors import DamagedCopyError
from mirrord.store.restore import restore
from mirrord.store.resume import Candidate, recorded_candidates, recorded_manifest
from mirrord.store.targets import mirror_for

if TYPE_CHECKING:
    import argparse

    from mirrord.config import Config
    from mirrord.layouts import Layout
    from mirrord.store.mirror import ReadableStore

LOAD_SECONDS = 1800  # wall clock and CPU time of one unit's load
LOAD_MEMORY_BYTES = 16 * 2**30  # address space beside the unit's own size (mmap maps it, torch's libraries)


def run_drill(config: Config, args: argparse.Namespace) -> int:
    """Drill each run (or --run); 0 when every one loads, 1 naming the mirror file and the loader's error."""
    store = mirror_for(config.mirror_target, config.s3)
    opened, run = opened_run(store, "drill", "mirror", args.run)
    if not opened:
        return 2
    recorded = recorded_candidates(recorded_manifest(store, config.rules))
    loads = find_spec("torch") is not None
    runs: list[str | None] = [run] if run is not None else [*sorted(recorded)]
    drilled = [_drill(store, config.rules, r, loads, recorded.get(r or "", [])) for r in runs or [None]]
    ok = not any(d["error"] for d in drilled)
    if args.json:
        from mirrord.commands.report import drill_document, dumps

        print(dumps(drill_document(store.describe(), ok, loads, drilled)))
    for d in drilled:
        done = f"loaded {len(d['loaded'])} file(s)" if loads else "not loaded (structure only: torch is not installed)"
        line = f"drill {d['run']}: {d['path']}: " + (f"FAILED {d['file']}: {d['error']}" if d["error"] else done)
        print(printable(line), file=sys.stderr if args.json or d["error"] else sys.stdout)
    return 0 if ok else 1


def _drill(
    store: ReadableStore, layout: Layout, run: str | None, loads: bool, units: list[Candidate]
) -> dict[str, Any]:
    """Restore `run`'s newest verified unit into a scratch folder and load it with the reader of the layout its
    record names (else the config's); what happened, as --json says it. No unit of `run`: restore says why."""
    local = store.local_tree()
    mirror_side = local.root if local is not None and os.access(local.root, os.W_OK) else None
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
    import resource

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LOAD_MEMORY_BYTES + size,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (LOAD_SECONDS,) * 2)

    drops: list[dict[str, Any]] = [{}]
    if os.geteuid() == 0 and (nobody := {u.pw_name: u for u in pwd.getpwall()}.get("nobody")):
        for path in (scratch, *scratch.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)
        drops.insert(0, {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []})
    for drop in drops:
        # -P: the loader imports no module from the working directory (a torch.py where the drill was run)
        argv = [sys.executable, "-P", "-m", "mirrord.formats.loader", layout, str(scratch), key]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=LOAD_SECONDS, preexec_fn=bounded, check=False, **drop
            )
        except subprocess.TimeoutExpired:
            return {"file": key, "error": f"the loader did not finish in {LOAD_SECONDS} s"}
        except OSError:
            if not drop:
                raise
            continue  # nobody cannot run this interpreter
        if done.stdout.startswith("{"):  # else nobody could not read the copy, or the loader was killed
            return dict(json.loads(done.stdout))
    return {"file": key, "error": f"the loader exited {done.returncode}: {done.stderr.strip()[-2000:]}"}
