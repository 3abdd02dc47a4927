"""`--json` output of the one-shot commands: one JSON document per run, on stdout.

Every document carries `command`, `version` and `ok` (true exactly when the command exits 0); the
other fields are the command's own (docs/commands.md, "JSON output"). Paths on a volume are POSIX paths relative
to its root, as in the manifest; roots are absolute. Nothing is printed on stdout for exit status 2;
a command stopped by an error before it had a result prints `error_document` instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mirrord import __version__

if TYPE_CHECKING:  # types only: `latest --json` must not load the copy engine, the metrics and the log stack
    from mirrord.commands.sync import SyncReport
    from mirrord.errors import MirrordError
    from mirrord.service.pruner import PruneReport
    from mirrord.store.mirror import ReadableStore
    from mirrord.store.restore import Restored
    from mirrord.store.resume import Finding


def dumps(document: dict[str, Any]) -> str:
    """A --json document as text."""
    return json.dumps(document, indent=2, default=str)


def _head(command: str, ok: bool) -> dict[str, Any]:
    return {"command": command, "version": __version__, "ok": ok}


def error_document(command: str, exc: MirrordError) -> dict[str, Any]:
    """The command stopped before it had a result (an unreadable manifest, a mirror locked by another
    mirrord): exit status 1, and this instead of the command's own fields."""
    return {**_head(command, False), "error": {"reason": exc.reason, "path": str(exc.path), "cause": exc.cause}}


def verify_document(
    mirror: str, checked: int, intact: int, findings: Iterable[Finding], deep: bool, load: bool
) -> dict[str, Any]:
    """`verify --json`: what was checked and every problem found (`mirror`: the store's describe())."""
    findings = list(findings)
    problems = [{"path": f.path, "problem": f.problem, "detail": f.detail} for f in findings]
    ok = not any(f.is_problem for f in findings)  # unchecked and part are listed, never a failure
    return {
        **_head("verify", ok),
        "mirror": mirror,
        "deep": deep or load,
        "load": load,
        "checked": checked,
        "intact": intact,
        "problems": problems,
    }


def latest_document(
    store: ReadableStore, side: str, run: str | None, key: str | None, step: int | None
) -> dict[str, Any]:
    """`latest --json`: the checkpoint found (or none), its step and size; `path` is store.describe(key)."""
    state = store.stat(key) if key is not None else None
    return {
        **_head("latest", key is not None),
        "root": store.describe(),
        "side": side,
        "run": run,
        "path": store.describe(key) if key is not None else None,
        "relative_path": key,
        "step": step,
        "size": state.size if state is not None else None,
    }


def restore_document(mirror: str, result: Restored) -> dict[str, Any]:
    """`restore --json`: the unit brought back (or found already there) and each damaged copy passed over."""
    return {
        **_head("restore", True),
        "mirror": mirror,
        "path": str(result.path),
        "relative_path": result.key,
        "step": result.step,
        "size": result.size,
        "already_there": result.already_there,
        "damaged": [{"path": d.path, "cause": d.cause} for d in result.damaged],
    }


def drill_document(mirror: str, ok: bool, loads: bool, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """`drill --json`: per run the unit restored and loaded (`loaded`), or the mirror file and the error."""
    return {**_head("drill", ok), "mirror": mirror, "structure_only": not loads, "runs": runs}


def prune_document(report: PruneReport) -> dict[str, Any]:
    """What was deleted (`deleted`), or in a dry run what would be (`would_delete`); the other list is empty."""
    files = [
        {
            "volume": d.volume,
            "path": d.rel,
            "run": d.state.run or ".",
            "step": d.step,
            "kind": d.kind,
            "size": d.state.size,
        }
        for d in report.deleted
    ]
    freed = {"mirror": report.freed_bytes("mirror"), "primary": report.freed_bytes("primary")}
    return {
        **_head("prune", report.ok),
        "dry_run": report.dry_run,
        "disabled": report.disabled,
        "refused": [{"reason": r, "detail": d} for r, d in report.refused],
        "deleted": [] if report.dry_run else files,
        "would_delete": files if report.dry_run else [],
        "freed_bytes": {v: 0 for v in freed} if report.dry_run else freed,
        "would_free_bytes": freed if report.dry_run else {v: 0 for v in freed},
        "kept": [{"volume": k.volume, "path": k.rel, "step": k.step, "why": k.why} for k in report.plan.kept],
        "skipped": [{"volume": s.volume, "path": s.rel, "step": s.step, "reason": s.reason} for s in report.skipped],
        "not_deleted": [{"volume": v, "path": rel, "why": why} for v, rel, why in report.changed + report.failed],
    }


def sync_document(report: SyncReport) -> dict[str, Any]:
    """`sync --json`: what was copied, failed, unsettled, or not published (a source not whole: `invalid`)."""
    return {
        **_head("sync", report.ok),
        "copied": sorted(report.copied),
        "failed": [{"path": rel, "error": err} for rel, err in sorted(report.failed.items())],
        "unsettled": sorted(report.unsettled),
        "gone": sorted(report.gone),
        "in_sync": report.in_sync,
        "listing_errors": list(report.listing_errors),
        "refused": report.refused,
        "invalid": [{"path": rel, "cause": cause} for rel, cause in sorted(report.invalid.items())],
    }
