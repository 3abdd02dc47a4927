"""What retention costs in requests at steady state, counted on the wire against a real S3 server: a real
`mirrord run` mirroring a run that keeps 100 checkpoints in the bucket, each new one copied and the oldest
pruned. A LIST is the dearest request S3 bills and the slowest on a big prefix: per checkpoint at most one."""

from __future__ import annotations

from pathlib import Path

from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support import s3requests
from tests.support.checkpoints import publish_checkpoint, save_checkpoint
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for

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
    primary = tmp_path / "primary"
    for step in range(KEPT):
        save_checkpoint(primary / "run" / f"step_{step}.pt", step)
    sent = tmp_path / "requests.log"
    daemon = DaemonProcess(
        tmp_path,
        primary,
        Path("/unused"),
        env=s3_env,
        wrapper=s3requests.wrapper(sent),
        settings={
            "s3": _settings(seaweed),
            "prune": {"enabled": True, "keep_last": KEPT, "min_age_seconds": 0},
            "watch": {"rescan_interval_seconds": 3600},  # the periodic rescan's LIST is per hour, not per checkpoint
        },
    )
    daemon.settings["mirror"] = f"s3://{bucket}/{prefix}"
    daemon.write_config()

    def pruned(step: int) -> None:
        """A new checkpoint is saved; wait until the pass that deleted the oldest one has finished."""
        publish_checkpoint(primary / "run" / f"step_{step}.pt", step)
        oldest = f"run/step_{step - KEPT}.pt"
        wait_for(
            lambda: (
                any(e.get("deleted") for e in daemon.events("prune.finished")[-1:])
                and daemon.events("prune.deleted", path=oldest)
            ),
            120,
            f"{oldest} pruned",
            context=lambda: daemon.log_text()[-3000:],
        )

    with daemon:
        wait_for(lambda: len(daemon.events("copy.committed")) >= KEPT, 300, "the first 100 checkpoints mirrored")
        pruned(KEPT)  # steady state: the bucket holds 100, each new checkpoint retires the oldest
        before = s3requests.counts(sent)
        for step in range(KEPT + 1, KEPT + 1 + MEASURED):
            pruned(step)
        after = s3requests.counts(sent)
    per_checkpoint = {op: (after[op] - before[op]) / MEASURED for op in after if after[op] > before[op]}
    lists = sum(per_checkpoint.get(op, 0) for op in s3requests.LISTS)
    assert lists <= 1, per_checkpoint
    assert len(daemon.events("prune.deleted")) == MEASURED + 1, "only the oldest checkpoint goes, one per new one"
