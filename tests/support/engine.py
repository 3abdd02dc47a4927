"""A copy made and committed on its own, the way the tests drive the engine (the daemon's pool batches commits)."""

from __future__ import annotations

from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.errors import MirrordError
from mirrord.service.copier import CopyControl
from mirrord.service.engine import Engine


def copy_once(engine: Engine, job: CopyJob, control: CopyControl | None = None) -> CopyResult:
    """stage() then commit() of that copy alone. Raises MirrordError."""
    staged = engine.stage(job, control)
    if isinstance(staged, CopyResult):
        return staged
    outcome = engine.commit([staged])[0]
    if isinstance(outcome, MirrordError):
        raise outcome
    return outcome
