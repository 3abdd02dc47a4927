"""`mirrord latest`: the CLI over mirrord.store.resume, where the resume logic lives (shared with
mirrord.torch and `mirrord restore`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from mirrord.config import Config



def run_latest(config: Config, args: argparse.Namespace) -> int:
    """Print the newest trustworthy checkpoint (or the --json document); 1 if there is none, 2 for a side
    that is not there or a bad --run."""
    from mirrord.core.model import step_of
    from mirrord.store.mirror import ReadableStore
    from mirrord.store.resume import latest_key, run_key
    from mirrord.store.targets import mirror_for
    from mirrord.store.volume import LocalVolume

    side = "primary" if args.primary_side else "mirror"
    store: ReadableStore = (LocalVolume(config.primary) if args.primary_side
                            else mirror_for(config.mirror_target, config.s3))
    if not store.exists():
        print(f"mirrord: latest: the {side} {store.describe()} does not exist or is not a directory "
              f"({side} / --{side})", file=sys.stderr)
        return 2
    try:
        run = run_key(store, args.run)
    except ValueError as exc:
        print(f"mirrord: config error: --run: {exc}", file=sys.stderr)
        return 2
    found = latest_key(store, run, require_manifest=not args.primary_side,
                       patterns=config.rules.patterns + config.rules.aliases, step_pattern=config.rules.step_pattern,
                       verify=args.verify, layout=config.rules)
    if args.json:
        from mirrord.commands.report import dumps, latest_document

        step = step_of(found, config.step_regex) if found is not None else None
        print(dumps(latest_document(store, side, args.run, found, step)))
    if found is None:
        print(f"no intact checkpoint under {store.describe()}" + (f" for run {args.run}" if args.run else ""),
              file=sys.stderr)
        return 1
    if not args.json:
        print(store.describe(found))
    return 0
