"""Copy one job with an Engine as a single attempt committed on its own, for tests that look at its result."""

from __future__ import annotations

from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.errors import MirrordError
from mirrord.service.copier import CopyControl
from mirrord.service.engine import Engine


def copy_once(engine: Engine, job: CopyJob, control: CopyControl | None = None) -> CopyResult:
    """engine.stage() then engine.commit() of that copy alone (what the worker pool and its commit stage
    do, without the threads). Raises MirrordError."""
    staged = engine.stage(job, control)
    if isinstance(staged, CopyResult):
        return staged
    outcome = engine.commit([staged])[0]
    if isinstance(outcome, MirrordError):
        raise outcome
    return outcome
