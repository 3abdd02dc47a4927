"""The `mirrord` command: subcommands, flags and exit codes. Builds the Config once and hands it down.

Exit codes: 0 success; 1 the operation failed (a copy, a mismatch, no intact checkpoint);
2 bad usage or configuration (one message per problem, naming the key).

This module imports only the standard library at load time: `mirrord -V`, shell completion and the
build step that writes the man page must not pay for pydantic and structlog (or need them installed).
`mirrord -V` does not even build the parser (argparse, pathlib and json are imported where used);
tests/integration/test_startup_imports.py holds each command to what it needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mirrord import __version__
from mirrord.commands.printable import printable
from mirrord.errors import ConfigError, ManifestError, MirrordError, StartupError

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from mirrord.config import Config, LoadedConfig, PrimaryNeed

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a program its pipe reader left
JSON_HELP = "print one JSON document on stdout instead of text (schema: docs/commands.md, JSON output)"

Command = Callable[["Config", "argparse.Namespace"], int]
PlainCommand = Callable[["argparse.Namespace"], int]  # commands that read no configuration

# One line per command: the list `mirrord` prints without arguments (and with --help).
SUMMARIES = {
    "run": "the daemon: watch, mirror, prune, serve /metrics /healthz /readyz",
    "sync": "copy every committed checkpoint the mirror lacks, once",
    "verify": "recheck every mirrored file against the manifest",
    "latest": "print the newest intact checkpoint",
    "restore": "bring the newest verified checkpoint back from the mirror (checked as it is written)",
    "drill": "restore each run's newest checkpoint into a scratch folder and load it with its library",
    "prune": "apply retention once (--dry-run prints the plan)",
    "status": "per run: newest step on each side, lag, free space, problems",
    "check-config": "validate the configuration; print it as TOML with each value's origin",
    "repair-manifest": "rebuild a lost or damaged manifest by re-hashing the mirror's files (offline)",
    "init": "write a commented config file (and with --systemd a unit) to start from",
    "demo": "a one-minute simulated training run against a local mirror",
    "completion": "print a bash, zsh or fish completion script",
    "man": "print the manual page (roff)",
}


def _stderr(text: str) -> None:
    """A line for the person at the terminal: stdout holds only the command's result."""
    print(text, file=sys.stderr)


def _common(parser: argparse.ArgumentParser) -> None:
    from pathlib import Path

    g = parser.add_argument_group("configuration (flags override MIRRORD_* variables, which override the file)")
    g.add_argument("--config", type=Path, metavar="FILE", help="TOML config file (default: $MIRRORD_CONFIG)")
    g.add_argument("--primary", type=Path, metavar="DIR", help="directory the trainer writes checkpoints to")
    g.add_argument(
        "--mirror",
        type=mirror_arg,
        metavar="DIR",
        help="directory (or s3://bucket/prefix) that holds the trustworthy copy",
    )
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    g.add_argument("--log-format", choices=["auto", "json", "console"], help="log rendering")


def mirror_arg(text: str) -> Path | str:
    """--mirror: a directory, or an s3:// URL kept as written (a Path would fold its '//' to '/')."""
    from pathlib import Path

    return text if text.startswith("s3://") else Path(text)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    data: dict[str, Any] = {k: str(v) for k in ("primary", "mirror") if (v := getattr(args, k)) is not None}
    log = {k: v for k, v in (("level", args.log_level), ("format", args.log_format)) if v is not None}
    return data | ({"log": log} if log else {})


def cmd_sync(config: Config, args: argparse.Namespace) -> int:
    """`mirrord sync`: one reconcile and copy pass, then exit (1 if anything failed)."""
    from mirrord.commands.sync import run_sync

    if not sys.stderr.isatty():
        report = run_sync(config)
    else:  # a live line per file being copied (bytes, rate, ETA); only this path imports the view
        from mirrord.commands.console import live_copies
        from mirrord.obs import log as logsetup
        from mirrord.service.progress import ProgressBoard

        board = ProgressBoard()
        with live_copies(board, sys.stderr) as log_stream:
            logsetup.configure(config.log.format, config.log.level, log_stream)  # log lines above the live lines
            try:
                report = run_sync(config, board=board)
            finally:
                logsetup.configure(config.log.format, config.log.level, sys.stderr)
    if args.json:
        from mirrord.commands.report import dumps, sync_document

        print(dumps(sync_document(report)))
    if report.refused is not None:
        _stderr(f"REFUSED: {report.refused}; nothing copied")
    lines = [
        *(f"FAILED {rel}: {err}" for rel, err in sorted(report.failed.items())),
        *(f"NOT PUBLISHED {rel}: {cause}" for rel, cause in sorted(report.invalid.items())),
        *(f"UNSETTLED {rel}: still changing; not copied" for rel in report.unsettled),
    ]
    for line in lines:
        _stderr(printable(line))
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_verify(config: Config, args: argparse.Namespace) -> int:
    """`mirrord verify`: check every manifest entry against the mirror (--deep re-hashes)."""
    from functools import partial

    from mirrord.commands.verify import deep_check, verify_mirror
    from mirrord.store.targets import mirror_for

    mirror = mirror_for(config.mirror_target, config.s3)
    if not mirror.exists():
        _stderr(
            f"mirrord: verify: the mirror {mirror.describe()} does not exist or is not a directory "
            "(mirror / --mirror); nothing to verify"
        )
        return EXIT_USAGE
    try:
        if args.load:  # (nothing else in the CLI imports torch)
            import torch  # noqa: F401
    except ImportError as exc:
        _stderr(
            f"mirrord: verify --load needs torch, which cannot be imported ({exc}): "
            "pip install 'mirrord[torch]' (--deep checks every record's CRC without torch)"
        )
        return EXIT_USAGE
    deep = partial(deep_check, load=args.load) if args.deep or args.load else None
    progress = _progress_bar if sys.stderr.isatty() else None
    checked, findings = verify_mirror(mirror, config.patterns, progress, deep, config.rules)
    # Findings about recorded files; unrecorded files and listing errors are problems, not checked files;
    # "unchecked" (a format without a validator, with --deep) and "part" (an intact file of a unit waiting
    # for other nodes' shares) are reported, never a problem.
    damaged = {
        f.path for f in findings if f.problem not in ("unrecorded", "unchecked", "part") and f.path != mirror.describe()
    }
    intact = checked - len(damaged)
    problems = [f for f in findings if f.is_problem]
    parts = sum(1 for f in findings if f.problem == "part")
    unchecked = len(findings) - len(problems) - parts
    if args.json:
        from mirrord.commands.report import dumps, verify_document

        print(dumps(verify_document(mirror.describe(), checked, intact, findings, args.deep, args.load)))
    else:
        for f in findings:
            print(printable(f"{f.problem.upper():14} {f.path}  {f.detail}"))
    print(
        f"verified {checked} file(s): {intact} intact, {len(problems)} problem(s)"
        + (f", {unchecked} unchecked (no validator for their format)" if unchecked else "")
        + (f", {parts} file(s) of units waiting for other nodes' shares" if parts else ""),
        file=sys.stderr if args.json else sys.stdout,
    )  # the result is stdout's; with --json, the document is
    return EXIT_FAILED if problems else EXIT_OK


def _progress_bar(done: int, total: int, path: str) -> None:
    frac = done / total if total else 1.0
    print(
        f"\r[{'#' * int(frac * 30):<30}] {frac:6.1%} {done / 2**30:7.2f}/{total / 2**30:.2f} GiB {path[-40:]:<40}",
        end="\n" if done >= total else "",
        file=sys.stderr,
        flush=True,
    )


def cmd_latest(config: Config, args: argparse.Namespace) -> int:
    """`mirrord latest`: print the newest trustworthy checkpoint (of a run, or overall)."""
    from mirrord.commands.latest import run_latest

    return run_latest(config, args)


def cmd_restore(config: Config, args: argparse.Namespace) -> int:
    """`mirrord restore`: the newest verified checkpoint (or --step), copied back and checked byte for byte."""
    from mirrord.commands.restore import run_restore

    return run_restore(config, args, _progress_bar if sys.stderr.isatty() else None)


def cmd_drill(config: Config, args: argparse.Namespace) -> int:
    """`mirrord drill`: each run's newest checkpoint restored to a scratch folder and loaded by its library."""
    from mirrord.commands.drill import run_drill

    return run_drill(config, args)


def cmd_run(config: Config, args: argparse.Namespace) -> int:
    """`mirrord run`: the daemon, until SIGTERM/SIGINT; SIGHUP reloads the config."""
    import faulthandler
    from functools import partial

    from mirrord.config import reload_config
    from mirrord.service.boot import run_daemon

    # When systemd's watchdog kills a wedged daemon (SIGABRT), every thread's stack reaches the journal.
    faulthandler.enable()

    if sys.stderr.isatty():
        from mirrord.commands.banner import run_banner

        print(run_banner(config, args.config), file=sys.stderr, flush=True)
    try:
        reread = partial(reload_config, args.config, overrides=_overrides(args), need_primary=args.needs_primary)
        return run_daemon(config, reread, getattr(args, "signals", None))
    except StartupError as exc:
        _stderr(f"mirrord: {exc}")
        return EXIT_USAGE


def cmd_repair_manifest(config: Config, args: argparse.Namespace) -> int:
    """`mirrord repair-manifest`: rebuild the manifest from the mirror's files (the old one is set aside)."""
    from mirrord.store.repair import repair_manifest

    report = repair_manifest(config)
    for rel, why in report.rejected:
        _stderr(f"NOT RECORDED {rel}: {why}")
    for msg in report.errors:
        _stderr(f"ERROR {msg}")
    if report.errors:
        _stderr("the mirror could not be listed completely: the manifest was NOT rewritten")
    else:
        print(
            f"manifest rebuilt: {len(report.recorded)} file(s) recorded, {len(report.rejected)} not recorded"
            + (f"; old manifest {report.old_manifest}" if report.old_manifest else "")
        )
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_check_config(config: Config, args: argparse.Namespace) -> int:
    """`mirrord check-config`: print the effective config (each value with its origin, or as JSON) and the
    checkpoint rules it implies; warns about patterns that can never match and, from a listing of the
    primary, about checkpoints with no step and checkpoint-like files the layout does not select."""
    from mirrord.core.units import naming_warnings
    from mirrord.layouts import never_matching
    from mirrord.store.scan import snapshot_tree

    warnings = never_matching(config.rules)
    if config.primary.is_dir():  # what a running daemon would warn about the primary's names
        listing = snapshot_tree(config.primary, config.patterns, layout=config.rules)
        warnings += [w.message for w in naming_warnings(listing, config.rules)]
    for warning in warnings:
        _stderr(f"warning: {warning}")
    if args.format == "json":
        import json

        print(json.dumps(config.to_toml_dict(), indent=2))
    else:
        from mirrord.commands.config_toml import render

        loaded: LoadedConfig = args.loaded  # main() loaded it with each value's origin
        print(render(config.to_toml_dict(), loaded.origin), end="")
        print("\n# effective checkpoint rules:")
        print("\n".join(f"#   {line}" for line in config.rules.describe()))
        mode, why = config.retention_mode
        print(f"# retention: prune.mode in force is {mode!r} ({why})")
        idle: tuple[str, ...] = ("keep_last", "keep_every") if mode == "follow" else ()
        if not config.prune.enabled:
            idle = tuple(key for key in type(config.prune).model_fields if key != "enabled")
        if idle:
            print(f"# no effect in this mode: {', '.join('prune.' + key for key in idle)}")
    if args.probe:  # a MirrordError (one line: where, what failed, why) is main()'s to print: exit 1
        from mirrord.commands.probe import probe_mirror
        from mirrord.store.targets import mirror_for

        print(f"probe: {probe_mirror(mirror_for(config.mirror_target, config.s3), config.mirror_url is not None)}")
    return EXIT_OK


# --- init, completion, man: no configuration read -----------------------------------------------------
def cmd_init(args: argparse.Namespace) -> int:
    """`mirrord init`: write a config file (and, with --systemd, a unit) for this machine."""
    from mirrord.commands import init

    path: Path = args.path
    config, unit, executable = path.absolute(), (path.parent / init.SYSTEMD_UNIT), init.mirrord_executable(sys.argv[0])
    files = {path: init.starter_config(args.primary, args.mirror)}
    if args.systemd:
        files[unit] = init.starter_unit(path, args.primary, args.mirror, executable)
    try:
        replaced = init.write_files(files, args.force)
    except (init.InitError, OSError) as exc:
        _stderr(f"mirrord init: {exc}")
        return EXIT_USAGE if isinstance(exc, init.InitError) else EXIT_FAILED
    for written in files:
        print(f"{'replaced' if written in replaced else 'wrote'} {written}")
    steps = [] if args.mirror is not None else [f"set mirror (required) in {config}"]
    if args.systemd:
        steps += init.systemd_next_steps(config, unit.absolute(), args.mirror)
        for warning in init.systemd_warnings(args.primary, args.mirror, executable):
            _stderr(f"warning: {warning}")
    else:
        steps += [f"mirrord check-config --config {config}", f"mirrord run --config {config}"]
    print("next:\n" + "\n".join(f"  {step}" for step in steps))
    return EXIT_OK


def cmd_completion(args: argparse.Namespace) -> int:
    """`mirrord completion SHELL`: print the shell completion script."""
    from mirrord.commands.completion import script

    print(script(args.shell, build_parser()), end="")
    return EXIT_OK


def cmd_man(args: argparse.Namespace) -> int:
    """`mirrord man`: print the man page (roff)."""
    from mirrord.commands.manpage import render

    print(render(build_parser(), __version__), end="")
    return EXIT_OK


# --- prune (retention; see mirrord/service/pruner.py) ---------------------------------------------------------
def _run_step(text: str) -> tuple[str, int]:
    """RUN:STEP of `prune --forget` as (run, step); '.' is the root's own run."""
    import argparse

    run, sep, step = text.rpartition(":")
    if not sep or not step.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected RUN:STEP, e.g. run1:600")
    return ("" if run in (".", "") else run.strip("/"), int(step))


def cmd_prune(config: Config, args: argparse.Namespace) -> int:
    """`mirrord prune`: one retention pass (--dry-run shows what would go)."""
    import contextlib

    from mirrord.commands.latest import opened_run
    from mirrord.commands.prune import describe
    from mirrord.obs import log as logsetup
    from mirrord.service.pruner import Pruner, PruneReport
    from mirrord.store.targets import mirror_for
    from mirrord.store.volume import LocalVolume

    dry_run = args.dry_run or config.prune.dry_run
    mirror = mirror_for(config.mirror_target, config.s3)
    if not opened_run(mirror, "prune", "mirror", None)[0]:  # a mistyped mirror is not "nothing to delete"
        return EXIT_USAGE
    # A dry run only reads: no lock (it runs beside a daemon), no mirror directory or lock file created.
    with contextlib.nullcontext() if dry_run else mirror.lock():
        try:
            manifest = mirror.load_manifest() if dry_run else mirror.read_manifest()
        except ManifestError as exc:
            # Without the manifest nothing is known to be verified: delete nothing.
            logsetup.get_logger().error("prune.refused", reason=exc.reason, detail=exc.cause, deleted=0)
            print(f"REFUSED (manifest): {exc}; nothing deleted", file=sys.stderr)
            report, read = PruneReport(dry_run=dry_run, refused=[(exc.reason, str(exc))]), False
        else:
            read = True
            report = Pruner(
                config, LocalVolume(config.primary), mirror, manifest, forget=frozenset(args.forget)
            ).run_cycle(dry_run=True if dry_run else None)
            if not dry_run:
                manifest.close()
    if args.json:
        from mirrord.commands.report import dumps, prune_document

        print(dumps(prune_document(report)))
    elif read:  # (a manifest that could not be read was said on stderr)
        print("\n".join(map(printable, describe(report).split("\n"))))
    return EXIT_OK if report.ok else EXIT_FAILED


# --- end prune -----------------------------------------------------------------------------------


# --- status and demo (see mirrord/commands/status.py, mirrord/commands/demo.py) --------------------------------------
def cmd_status(config: Config, args: argparse.Namespace) -> int:
    """`mirrord status`: both volumes, the manifest, the lag and the daemon, in one report."""
    from mirrord.commands.report import dumps
    from mirrord.commands.status import collect, render

    status = collect(config, deep=args.verify, timeout=args.timeout, max_lag=args.max_lag)
    print(dumps(status.to_dict()) if args.json else render(status))
    return EXIT_OK if status.ok else EXIT_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    """`mirrord demo`: a simulated trainer and a real daemon in DIR, to watch mirrord work."""
    from mirrord.commands.demo import DemoError, DemoOptions, run_demo

    if args.primary is not None or args.mirror is not None:
        _stderr("mirrord: the demo always uses DIR/primary and DIR/mirror; choose DIR with --dir")
        return EXIT_USAGE
    if args.config is not None:
        _stderr(f"mirrord demo: --config {args.config} is ignored: the demo writes and uses DIR/mirrord.toml")
    options = DemoOptions(args.dir, args.steps, args.interval, args.keep_last, False if args.no_torch else None)
    try:
        return run_demo(options)
    except DemoError as exc:
        _stderr(f"mirrord demo: {exc}")
        return EXIT_USAGE


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` (int or float) greater than 0."""

    def parse(text: str) -> Any:
        import argparse

        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value

    return parse


# --- end status and demo -----------------------------------------------------------------------------


def _flags(parser: argparse.ArgumentParser, helps: dict[str, str]) -> None:
    """Options that take no value (each `--name` is True when given), in this order."""
    for flag, help_ in helps.items():
        parser.add_argument(flag, action="store_true", help=help_)


def _help_formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's own formatter, as wide as the terminal, sized as shutil.get_terminal_size would (COLUMNS,
    else stdout's terminal, else 80) without importing shutil (and bz2 and lzma with it): argparse makes a
    formatter for every argument it adds, to check it, so every command paid for that import."""
    import argparse
    import os

    try:
        columns = max(int(os.environ.get("COLUMNS", 0)), 0) or os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):  # no stdout, not a terminal
        columns = 0
    return argparse.HelpFormatter(prog, width=(columns or 80) - 2)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also the source of the man page and the shell completions)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="mirrord",
        description="Keep a second, always-trustworthy copy of ML training checkpoints. "
        "A checkpoint exists on the mirror only when it is whole: copied as NAME.part, fsynced, "
        "verified, renamed into place, and recorded with its size and hash in a manifest.",
        epilog="Exit codes: 0 ok, 1 operation failed, 2 bad usage or configuration.",
        formatter_class=_help_formatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"mirrord {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def add(
        name: str,
        func: Command | PlainCommand,
        help_: str,
        needs_primary: PrimaryNeed = True,
        config: bool = True,
        json: bool = False,
    ) -> argparse.ArgumentParser:
        """A subcommand; with config=False it gets no configuration (func takes only the arguments)."""
        p = sub.add_parser(name, help=SUMMARIES[name], description=help_, formatter_class=_help_formatter)
        p.set_defaults(parser=p)  # for the usage and the suggestion when a flag is mistyped
        if config:
            _common(p)
            p.set_defaults(func=func, needs_primary=needs_primary)
        else:
            p.set_defaults(plain=func)
        if json:  # after the configuration flags: the order --help, the man page and the completions show
            _flags(p, {"--json": JSON_HELP})
        return p

    p = add(
        "sync",
        cmd_sync,
        "One full pass: copy every committed checkpoint the mirror lacks, then exit "
        "(0 if all copies succeeded, 1 if any failed). On a terminal, each copy under way shows its "
        "bytes, rate and ETA.",
        json=True,
    )
    p = add(
        "verify",
        cmd_verify,
        "Recheck every mirrored file against the manifest (size and hash); list "
        "mismatches, missing and unrecorded files; exit 1 on any problem, 2 if the mirror does not exist "
        "or --load is asked for without torch installed.",
        needs_primary=False,
        json=True,
    )
    _flags(
        p,
        {
            "--deep": "also run the format validator on every file, recorded or not: a torch.save zip's "
            "structure and every record's CRC-32 (no torch needed), safetensors, JSON; other formats "
            "are reported as unchecked, not as problems",
            "--load": "also torch.load each file (weights_only, mmap) to prove it deserializes; needs torch "
            "(pip install 'mirrord[torch]')",
        },
    )
    p = add(
        "latest",
        cmd_latest,
        "Print the newest verified checkpoint: recorded in the manifest (its source "
        "passed its format validator), still the file that was recorded (by inode, size, mtime and "
        "ctime; re-hashed when they differ). Newest is by step within a run, the newest branch first "
        "after a rollback; without --run, the run whose best checkpoint is newest by mtime. Exit 1 if "
        "there is none, 2 if the mirror does not exist.",
        needs_primary=False,
        json=True,
    )
    p.add_argument("--run", metavar="DIR", help="only this run (folder relative to the root)")
    _flags(
        p,
        {
            "--verify": "re-read each candidate: content hash and format validator, not only stat",
            "--primary-side": "look on the primary instead (no manifest there: newest file whose zip CRCs check out)",
        },
    )
    p = add(
        "restore",
        cmd_restore,
        "Bring back from the mirror (local or s3://) the newest verified unit (file "
        "or folder) of the mirror's only run (with several: of --run), or of --step; print its path. Every byte is "
        "checked against the manifest's hash as it is written as NAME.part (NAME.part/); only a matching copy is "
        "fsynced and renamed into place, with its source's mtime, so sync and the daemon copy nothing again. A "
        "damaged copy is never published: without --step the next newest verified unit is restored instead "
        "(each damaged copy named on stderr; exit 0 once one is restored). An identical copy at the destination "
        "is left alone, a different one replaced only with --force. Reads the mirror only. Exit 1 if nothing "
        "could be restored (none recorded, all damaged, a damaged --step, a different file in the way, no --run "
        "among several runs or one the mirror does not hold), 2 if "
        "the mirror does not exist.",
        needs_primary=False,
    )
    p.add_argument("--run", metavar="DIR", help="only this run (folder relative to the mirror's root)")
    p.add_argument("--step", type=int, metavar="N", help="this step (no fallback if its copy is damaged)")
    p.add_argument(
        "--to",
        type=Path,
        metavar="DIR",
        help="root to restore below, at the same relative path (default: the configured primary)",
    )
    _flags(p, {"--force": "replace a different file or folder at the destination", "--json": JSON_HELP})
    p = add(
        "drill",
        cmd_drill,
        "Prove each run's newest checkpoint (or --run's) can be brought back and loaded: restore its newest "
        "verified unit as `restore` does (every byte checked against the manifest) into a scratch folder on the "
        "mirror's side (a hidden .mirrord-drill-* folder in a local mirror's root; the system temp dir for S3 or "
        "a mirror this user cannot write), load it in a separate process bounded in time and memory (as nobody "
        "when run as root and nobody can) with the layout's own reader (torch.load weights_only and mmap; "
        "safetensors for hf and hf_model; the .metadata and its storage references for dcp; every rank's file "
        "for deepspeed and megatron), then delete the scratch folder. Without torch installed it checks bytes "
        "and structure only, and says so. Reads the mirror only. Exit 1 naming the mirror file and the "
        "loader's error when one does not load, 2 if the mirror does not exist.",
        needs_primary=False,
        json=True,
    )
    p.add_argument("--run", metavar="DIR", help="only this run (folder relative to the mirror's root)")
    add(
        "run",
        cmd_run,
        "Run the daemon: watch the primary, mirror every committed checkpoint, prune old "
        "ones, drill each run's newest checkpoint once the copies are done and daily ([drill]), re-read the "
        "mirror against its hashes weekly ([scrub]; a bucket only with scrub.s3), serve /metrics "
        "/healthz /readyz /status. SIGTERM/SIGINT stop it cleanly (a second one aborts "
        "copies under way), SIGHUP reloads the config. On a terminal it first prints the retention in force, "
        "its endpoints and the command that shows its status. A primary root that does not exist yet is "
        "waited for (alive, not ready).",
        needs_primary="later",
    )
    p = add(
        "check-config",
        cmd_check_config,
        "Validate the configuration (file, MIRRORD_* variables, flags) and "
        "print the effective values as TOML that can be pasted into a config file, each value followed by a "
        "comment saying where it came from (default, file, environment variable, flag). Exit 2 if invalid.",
    )
    p.add_argument(
        "--format",
        choices=["toml", "json"],
        default="toml",
        help="toml (default): for a person, with origins; json: the values only, for machines",
    )
    _flags(
        p,
        {
            "--probe": "also reach the mirror (a folder or S3), write a test object, read it back and delete it; "
            "exit 1 with the cause if any step fails"
        },
    )
    add(
        "repair-manifest",
        cmd_repair_manifest,
        "Rebuild a lost or damaged manifest from the mirror's files "
        "(offline: takes the mirror lock). Every file is re-hashed and validated (same content as its source "
        "on the primary, or a torch.save zip whose CRCs check out) before it is recorded; the old snapshot and "
        "journals are kept with a .damaged suffix. Exit 0 if every file was recorded, 1 otherwise.",
    )
    # --- prune ---
    p = add(
        "prune",
        cmd_prune,
        "Delete old checkpoints on the mirror (and on the primary with "
        "prune.primary = true), keeping each run's prune.keep_last newest verified steps; print what "
        "was deleted, kept and skipped; exit 1 if the cycle was refused (partial listing, unreadable "
        "manifest, mirror looks unmounted).",
    )
    _flags(
        p,
        {
            "--dry-run": "print the plan, delete nothing (as prune.dry_run = true); takes no lock and writes "
            "nothing, so it runs beside a daemon"
        },
    )
    p.add_argument(
        "--forget",
        "--forget-branch",
        dest="forget",
        action="append",
        default=[],
        metavar="RUN:STEP",
        type=_run_step,
        help="let retention delete this checkpoint it keeps on its own account: the tip of an abandoned branch "
        "(a rollback or a restart from scratch), of a run paused because its primary lost its newest step, or "
        "(follow mode) one gone from the primary without evidence the trainer rotated it (a wipe, a restore, "
        "an rm); RUN is the run folder relative to the roots ('.' for the root itself); repeatable "
        "(--forget-branch is the same flag)",
    )
    _flags(p, {"--json": JSON_HELP})
    # --- end prune ---
    # --- status and demo ---
    p = add(
        "status",
        cmd_status,
        "For a person: per run, the newest step on the primary and on the mirror, "
        "whether the newest mirrored step is intact, how far the mirror is behind, free space on both volumes, "
        "and problems (with a folder layout, also each unit the mirror lacks: incomplete, pending or retired, as "
        "the daemon judges it); plus, if a daemon answers on metrics.address, its health, readiness, queue, copy "
        "counts and each copy under way (bytes, rate, ETA). Reads only: safe while the daemon runs. Exit 0 if "
        "nothing is wrong, 1 if a problem is listed (newest mirrored step not intact, files missing from the "
        "mirror, unreadable or missing manifest while the primary holds checkpoints, a run more than --max-lag "
        "behind, daemon unhealthy or refusing the mirror).",
        needs_primary=False,
    )
    _flags(
        p,
        {
            "--json": "print the report as JSON (same fields, for scripts)",
            "--verify": "check the content hash of each run's newest mirrored step, not only its size "
            "(reads those files in full)",
        },
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=1.0,
        metavar="SECONDS",
        help="how long to wait for the daemon's HTTP endpoint (default: 1)",
    )
    p.add_argument(
        "--max-lag",
        type=_positive(float),
        default=900.0,
        metavar="SECONDS",
        help="a run whose oldest unmirrored checkpoint is older than this is a problem "
        "(exit 1), not just lag (default: 900, as the MirrordMirrorLagging alert)",
    )
    p = add(
        "demo",
        cmd_demo,
        "See mirrord work in about a minute: a simulated trainer commits real checkpoints "
        "(torch.save when torch is installed, torch-like zip files otherwise) into DIR/primary while a `mirrord "
        "run` daemon mirrors them to DIR/mirror and prunes old steps on both sides; every commit, copy and "
        "deletion is narrated, then `mirrord status` is shown. DIR keeps the config and the daemon's log. "
        "--config/--primary/--mirror are not used: the demo writes DIR/mirrord.toml.",
        config=False,
    )
    _common(p)
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("var/demo"),
        metavar="DIR",
        help="where to put primary/, mirror/, mirrord.toml and mirrord.log (default: ./var/demo; "
        "must be empty or made by an earlier demo, which is wiped)",
    )
    p.add_argument(
        "--steps", type=_positive(int), default=20, metavar="N", help="checkpoints the trainer commits (default: 20)"
    )
    p.add_argument(
        "--interval",
        type=_positive(float),
        default=2.5,
        metavar="SECONDS",
        help="time between two commits (default: 2.5)",
    )
    p.add_argument(
        "--keep-last",
        type=_positive(int),
        default=3,
        metavar="N",
        help="steps retention keeps on each side (prune.keep_last; default: 3)",
    )
    _flags(p, {"--no-torch": "write torch-like zip files even if torch is installed (starts faster)"})
    # --- end status and demo ---
    p = add(
        "init",
        cmd_init,
        "Write a configuration file to start from: the example config with every key "
        "documented and set to its default, the roots filled in from --primary/--mirror. With --systemd, also "
        "write mirrord.service next to it, pointed at that file and those roots. An existing file is never "
        "replaced without --force; files are written atomically.",
        config=False,
    )
    p.add_argument(
        "path",
        nargs="?",
        type=Path,
        default=Path("mirrord.toml"),
        metavar="PATH",
        help="the config file to write (default: ./mirrord.toml); missing folders are created",
    )
    p.add_argument("--primary", type=Path, metavar="DIR", help="the directory the trainer writes checkpoints to")
    p.add_argument(
        "--mirror",
        type=mirror_arg,
        metavar="DIR",
        help="the directory (or s3://bucket/prefix) for the trustworthy copy (required to run; else set it later)",
    )
    _flags(
        p,
        {
            "--systemd": "also write the systemd unit mirrord.service next to PATH",
            "--force": "replace files that exist",
        },
    )
    p = add(
        "completion",
        cmd_completion,
        "Print a shell completion script generated from this command's own "
        "parser. bash: `source <(mirrord completion bash)` (or save it as /etc/bash_completion.d/mirrord); zsh: "
        "save it as _mirrord in a folder of $fpath; fish: save it as ~/.config/fish/completions/mirrord.fish. "
        "Wheels also ship them under mirrord/data/completion/.",
        config=False,
    )
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete for")
    add(
        "man",
        cmd_man,
        "Print the manual page mirrord(1) in roff, generated from this command's own parser: "
        "`mirrord man | man -l -`. Wheels also ship it as mirrord/data/man/mirrord.1.",
        config=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `mirrord` command: parse, load the config once, run the subcommand; its exit status.

    A reader that went away (`mirrord check-config | head`) ends the command quietly with 141, as a
    program killed by SIGPIPE, instead of a traceback; stdout is flushed here so that is found here."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        return EXIT_BROKEN_PIPE
    return code


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket nobody reads any more (the BrokenPipeError was about it)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):
        return False


def _main(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["-V"], ["--version"]):  # what argparse prints, without building every subcommand's parser
        print(f"mirrord {__version__}")
        return EXIT_OK
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, and the closest of its flags (argparse's suggest_on_error is 3.14)
        import difflib

        here: argparse.ArgumentParser = getattr(args, "parser", parser)
        close = difflib.get_close_matches(unknown[0].partition("=")[0], list(here._option_string_actions), n=1)
        here.error(f"unrecognized arguments: {' '.join(unknown)}" + (f"; did you mean {close[0]}?" if close else ""))
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "run":
        from mirrord.service.signals import SignalFlags

        # First thing: a SIGHUP or SIGTERM while the daemon is still starting is recorded, not fatal.
        args.signals = SignalFlags().install()
    from mirrord.obs import log as logsetup

    plain: PlainCommand | None = getattr(args, "plain", None)
    if plain is not None:  # no configuration read: the log as the flags say (demo has them), else the defaults
        logsetup.configure(
            getattr(args, "log_format", None) or "auto", getattr(args, "log_level", None) or "info", sys.stderr
        )
        try:
            return int(plain(args))
        except KeyboardInterrupt:
            return 130
    from mirrord.config import explain_config

    try:  # file + environment + flags, roots checked as the command needs, with each value's origin
        loaded = explain_config(args.config, overrides=_overrides(args), need_primary=args.needs_primary)
    except ConfigError as exc:
        for problem in exc.problems:
            _stderr(f"mirrord: config error: {problem}")
        return EXIT_USAGE
    config, ignored = loaded.config, loaded.ignored_environment
    args.loaded = loaded  # check-config prints each value's origin from it
    if (why := _write_problem(config, args)) is not None:
        _stderr(f"mirrord: {why}")
        return EXIT_USAGE
    logsetup.configure(config.log.format, config.log.level, sys.stderr if args.command != "run" else None)
    if ignored:  # once per process: a SIGHUP reload does not repeat it
        logsetup.get_logger().info(
            "config.environment_ignored",
            variables=list(ignored),
            why="Kubernetes service variables, not mirrord settings",
        )
    if args.command == "run":
        logsetup.get_logger().info(
            "config.loaded",
            file=str(loaded.file) if loaded.file else None,
            primary=str(config.primary),
            mirror=str(config.mirror_target),
        )
    if args.command in ("sync", "drill"):
        _stop_on_hangup_and_term()
    try:
        return int(args.func(config, args))
    except MirrordError as exc:
        if args.command == "run" or config.log.format == "json":  # else one readable line, not a log line first
            logsetup.get_logger().error(
                "command.failed", command=args.command, reason=exc.reason, path=exc.path, cause=exc.cause
            )
        _stderr(printable(f"mirrord: {exc}"))
        if getattr(args, "json", False) and args.command != "status":
            from mirrord.commands.report import dumps, error_document

            print(dumps(error_document(args.command, exc)))  # --json promised a document: say why there is none
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        import signal

        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT  # Ctrl-C
        logsetup.get_logger().warning(
            "command.interrupted",
            command=args.command,
            signal=signal.Signals(signum).name,
            action="copies under way aborted, their temp files removed",
        )
        return 128 + signum


def _stop_on_hangup_and_term() -> None:
    """SIGHUP (a closed terminal) and SIGTERM stop a one-shot copy as Ctrl-C does: the copies under way
    are aborted and their temp files removed, instead of the process dying with a `.part` left behind
    (a drill: its loader killed, its scratch copy removed)."""
    import signal

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signum)

    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, interrupt)


# What writes to the mirror; every other command (latest, status, verify, prune --dry-run, restore,
# check-config) reads it only, and works with read access alone.
WRITE_COMMANDS = ("run", "sync", "prune", "repair-manifest")


def _write_problem(config: Config, args: argparse.Namespace) -> str | None:
    """Why this command cannot write the local mirror it must write (not writable by us, a read-only mount)."""
    import os

    mirror, writes = config.mirror, args.command in WRITE_COMMANDS and not getattr(args, "dry_run", False)
    if writes and config.mirror_url is None and mirror.is_dir() and not os.access(mirror, os.W_OK | os.X_OK):
        return (
            f"{args.command}: the mirror {mirror} is not writable by this user (or is mounted read-only); "
            f"`{args.command}` writes to it. Reading needs no write access: latest, status, verify, "
            "prune --dry-run, restore"
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
