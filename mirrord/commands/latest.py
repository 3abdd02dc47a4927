"""`mirrord latest`: the CLI over mirrord.store.resume, where the resume logic lives (shared with
mirrord.torch and `mirrord restore`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from mirrord.config import Config
    from mirrord.store.mirror import ReadableStore


def opened_run(store: ReadableStore, command: str, side: str, run: str | None) -> tuple[bool, str | None]:
    """(True, the run key `--run` names on `store`, None without --run), or (False, None) once the reason
    it cannot be answered (the store is not there, a bad --run) is printed: the command then exits 2."""
    from mirrord.store.resume import run_key

    if not store.exists():
        print(
            f"mirrord: {command}: the {side} {store.describe()} does not exist or is not a directory "
            f"({side} / --{side})",
            file=sys.stderr,
        )
        return False, None
    try:
        return True, run_key(store, run)
    except ValueError as exc:
        print(f"mirrord: config error: --run: {exc}", file=sys.stderr)
        return False, None


def run_latest(config: Config, args: argparse.Namespace) -> int:
    """Print the newest trustworthy checkpoint (or the --json document); 1 if there is none, 2 for a side
    that is not there or a bad --run."""
    from mirrord.core.model import step_of
    from mirrord.store.resume import latest_key
    from mirrord.store.targets import mirror_for
    from mirrord.store.volume import LocalVolume

    side = "primary" if args.primary_side else "mirror"
    store: ReadableStore = (
        LocalVolume(config.primary) if args.primary_side else mirror_for(config.mirror_target, config.s3)
    )
    opened, run = opened_run(store, "latest", side, args.run)
    if not opened:
        return 2
    found = latest_key(
        store,
        run,
        require_manifest=not args.primary_side,
        patterns=config.rules.patterns + config.rules.aliases,
        step_pattern=config.rules.step_pattern,
        verify=args.verify,
        layout=config.rules,
    )
    if args.json:
        from mirrord.commands.report import dumps, latest_document

        step = step_of(found, config.step_regex) if found is not None else None
        print(dumps(latest_document(store, side, args.run, found, step)))
    if found is None:
        print(
            f"no intact checkpoint under {store.describe()}" + (f" for run {args.run}" if args.run else ""),
            file=sys.stderr,
        )
        return 1
    if not args.json:
        print(store.describe(found))
    return 0
