"""`mirrord drill`: prove each run's newest checkpoint can be brought back and loaded, before the day it is needed
(mirrord.store.drill), once, from the CLI. Without torch the drill checks the bytes and the structure the
record vouches for, and says it loaded nothing.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from typing import TYPE_CHECKING

from mirrord.commands.latest import opened_run
from mirrord.commands.printable import printable
from mirrord.store.drill import drill
from mirrord.store.resume import recorded_candidates, recorded_manifest
from mirrord.store.targets import mirror_for

if TYPE_CHECKING:
    import argparse

    from mirrord.config import Config


def run_drill(config: Config, args: argparse.Namespace) -> int:
    """Drill each run (or --run); 0 when every one loads, 1 naming the mirror file and the loader's error."""
    store = mirror_for(config.mirror_target, config.s3)
    opened, run = opened_run(store, "drill", "mirror", args.run)
    if not opened:
        return 2
    recorded = recorded_candidates(recorded_manifest(store, config.rules))
    loads = find_spec("torch") is not None
    runs: list[str | None] = [run] if run is not None else [*sorted(recorded)]
    drilled = [drill(store, config.rules, r, loads, recorded.get(r or "", [])) for r in runs or [None]]
    ok = not any(d["error"] for d in drilled)
    if args.json:
        from mirrord.commands.report import drill_document, dumps

        print(dumps(drill_document(store.describe(), ok, loads, drilled)))
    for d in drilled:
        done = f"loaded {len(d['loaded'])} file(s)" if loads else "not loaded (structure only: torch is not installed)"
        line = f"drill {d['run']}: {d['path']}: " + (f"FAILED {d['file']}: {d['error']}" if d["error"] else done)
        print(printable(line), file=sys.stderr if args.json or d["error"] else sys.stdout)
    return 0 if ok else 1
