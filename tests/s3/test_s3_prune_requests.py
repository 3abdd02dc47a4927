"""What retention costs in requests at steady state, counted on the wire against a real S3 server: a real
`mirrord run` mirroring a run that keeps 100 checkpoints in the bucket, each new one copied and the oldest
pruned. A LIST is the dearest request S3 bills and the slowest on a big prefix: per checkpoint at most one."""

from __future__ import annotations

from pathlib import Path

from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support import s3requests

KEPT = 100
MEASURED = 8  # checkpoints counted, after one that brings the daemon to steady state


def test_a_checkpoint_at_steady_state_costs_at_most_one_list(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """With keep_last = 100 checkpoints in the bucket, each new checkpoint is uploaded and the oldest deleted
    (and nothing else), with at most one LIST request (ListObjectsV2, ListMultipartUploads) per checkpoint: the
    prune pass after a copy plans from the last listing plus the daemon's own copies and deletions since (the one
    listing left confirms the 99 copies the deletion rests on, more than a HEAD each is worth); no refresh of the
    manifest, no sweep of stale uploads, no LIST for the new key's stat."""
    per_checkpoint, deleted = s3requests.steady_state(
        tmp_path, f"s3://{bucket}/{prefix}", s3_env, _settings(seaweed), KEPT, MEASURED
    )
    lists = sum(per_checkpoint.get(op, 0) for op in s3requests.LISTS)
    assert lists <= 1, per_checkpoint
    assert deleted == MEASURED + 1, "only the oldest checkpoint goes, one per new one"
