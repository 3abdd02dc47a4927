"""`mirrord prune`'s words for a person: what a retention pass (mirrord.service.pruner) did or would do."""

from __future__ import annotations

from mirrord.core.retention import MIRROR, PRIMARY
from mirrord.obs.sizes import human_bytes
from mirrord.service.pruner import PruneReport


def describe(report: PruneReport) -> str:
    """For a person: what was (or would be) deleted, what is kept and why, what a guard skipped."""
    if report.disabled:
        return "pruning is disabled (prune.enabled = false): nothing deleted; --dry-run shows the plan"
    plan = report.plan
    lines = [f"REFUSED ({reason}): {detail}" for reason, detail in report.refused]
    verb = "would delete" if report.dry_run else "deleted"
    rels = [d.rel for d in report.deleted] + [k.rel for k in plan.kept] + [s.rel for s in report.skipped]
    width = max(map(len, rels), default=0)
    lines.append(f"{verb} {len(report.deleted)} file(s), {human_bytes(report.freed_bytes())}:")
    for d in report.deleted:
        what = d.kind if d.step is None else f"step {d.step}"
        lines.append(f"  {d.volume:8} {d.rel:{width}}  {what}  {human_bytes(d.state.size)}")
    lines.append(f"kept {len(plan.kept)} file(s):")
    lines.extend(f"  {k.volume:8} {k.rel:{width}}  {k.why}" for k in plan.kept)
    lines.append(f"skipped {len(report.skipped)} file(s):")
    lines.extend(f"  {s.volume:8} {s.rel:{width}}  {s.reason}" for s in report.skipped)
    if report.changed or report.failed:
        lines.append(f"not deleted {len(report.changed) + len(report.failed)} file(s):")
        lines.extend(f"  {v:8} {rel}  {why}" for v, rel, why in report.changed + report.failed)
    freed = ", ".join(f"{v} {human_bytes(report.freed_bytes(v))}" for v in (MIRROR, PRIMARY))
    skips = ", ".join(f"{r}={n}" for r, n in sorted(report.skips_by_reason().items())) or "none"
    outcome = f"{verb} {len(report.deleted)} file(s) ({freed})"
    if report.refused:
        outcome = f"REFUSED; {outcome}"
    lines.append(
        f"summary: {outcome}; kept {len(plan.kept)}; skipped: {skips}"
        + ("; dry run: nothing was deleted" if report.dry_run else "")
    )
    return "\n".join(lines)
