"""with fewer than keep_last verified steps nothing is below the window (damage is repaired, not pruned)."""

from __future__ import annotations

import re

from mirrord.config import PruneConfig
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.retention import PruneRequest, plan_prune

NOW = 1_700_000_000.0
OLD = int((NOW - 3600) * 1e9)


def test_a_damaged_older_copy_in_a_short_run_is_neither_pruned_nor_retired() -> None:
    """keep_last=12, two steps, step 1's mirror copy truncated: keep both sides' step 1 so it is recopied."""
    primary = Snapshot({f"r/step_{s}.pt": FileState(f"r/step_{s}.pt", 1000, OLD + s, ino=s) for s in (1, 2)})
    mirror = Snapshot(
        {
            "r/step_1.pt": FileState("r/step_1.pt", 100, OLD + 1, ino=11),
            "r/step_2.pt": FileState("r/step_2.pt", 1000, OLD + 2, ino=12),
        }
    )
    manifest = {f"r/step_{s}.pt": ManifestEntry(f"r/step_{s}.pt", 1000, "blake3", "d", OLD + s, s, 0.0) for s in (1, 2)}
    policy = PruneConfig(keep_last=12, primary=True, min_age_seconds=0)
    plan = plan_prune(primary, mirror, manifest, PruneRequest(policy, re.compile(r"step_(\d+)"), NOW))
    assert plan.deletions == ()
    assert not plan.retired("r", 1)
