"""`mirrord restore`: the way back when the primary is gone (the work is mirrord.store.restore)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mirrord.commands.latest import opened_run
from mirrord.commands.printable import printable
from mirrord.store.restore import Progress, restore
from mirrord.store.targets import mirror_for

if TYPE_CHECKING:
    import argparse

    from mirrord.config import Config


def run_restore(config: Config, args: argparse.Namespace, progress: Progress | None) -> int:
    """Restore, print the restored path (or the --json document); 2 for a mirror that is not there or a
    bad --run. Errors (nothing to restore, a damaged copy with --step, a taken destination) propagate."""
    store = mirror_for(config.mirror_target, config.s3)
    opened, run = opened_run(store, "restore", "mirror", args.run)
    if not opened:
        return 2
    dest = Path(args.to) if args.to is not None else Path(config.primary)
    result = restore(store, dest, config.rules, run, args.step, args.force, progress)
    for damaged in result.damaged:
        print(
            printable(f"DAMAGED {damaged.path}: {damaged.cause}; falling back to the next newest verified checkpoint"),
            file=sys.stderr,
        )
    if args.json:
        from mirrord.commands.report import dumps, restore_document

        print(dumps(restore_document(store.describe(), result)))
    else:
        print(result.path)
    print(
        printable(
            f"{result.path}: already there (identical to the mirror's copy); nothing written"
            if result.already_there
            else f"restored {result.path} ({result.size} bytes) from {store.describe(result.key)}"
        ),
        file=sys.stderr,
    )
    return 0
