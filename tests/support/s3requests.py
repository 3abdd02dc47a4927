"""Every S3 request a real process sends, counted on the wire: run it as

    python -m tests.support.s3requests OUT PYTHON -m MODULE ARGS...

(DaemonProcess's `wrapper`: see wrapper()) and each HTTP request botocore sends (its before-send event: retries
included) appends its operation's name to OUT, one a line, as it happens; counts() reads them."""

from __future__ import annotations

import collections
import os
import runpy
import sys
from pathlib import Path
from typing import Any

# What S3 bills and rate-limits as LIST requests.
LISTS = ("ListObjectsV2", "ListObjects", "ListMultipartUploads", "ListParts")


def wrapper(out: Path) -> list[str]:
    """The DaemonProcess wrapper that counts the daemon's requests into `out`."""
    return [sys.executable, "-m", "tests.support.s3requests", str(out)]


def counts(out: Path) -> collections.Counter[str]:
    """The requests sent so far, by operation."""
    return collections.Counter(out.read_text().split()) if out.exists() else collections.Counter()


def steady_state(
    work: Path, mirror_url: str, env: dict[str, str], s3: dict[str, Any], kept: int, measured: int
) -> tuple[dict[str, float], int]:
    """Requests per checkpoint, by operation, of a real `mirrord run` keeping `kept` checkpoints of one run in
    the bucket: counted over `measured` new checkpoints (each uploaded, the oldest pruned) after one that brings
    the daemon to steady state; and how many checkpoints the daemon deleted in all."""
    from tests.support.checkpoints import publish_checkpoint, save_checkpoint
    from tests.support.daemon import DaemonProcess
    from tests.support.wait import wait_for

    primary = work / "primary"
    for step in range(kept):
        save_checkpoint(primary / "run" / f"step_{step}.pt", step)
    sent = work / "requests.log"
    daemon = DaemonProcess(
        work,
        primary,
        Path("/unused"),
        env=env,
        wrapper=wrapper(sent),
        settings={
            "s3": s3,
            "prune": {"enabled": True, "keep_last": kept, "min_age_seconds": 0},
            "watch": {"rescan_interval_seconds": 3600},  # the periodic rescan's LIST is per hour, not per checkpoint
        },
    )
    daemon.settings["mirror"] = mirror_url
    daemon.write_config()

    def pruned(step: int) -> None:
        """A new checkpoint is saved; wait until the pass that deleted the oldest one has finished."""
        publish_checkpoint(primary / "run" / f"step_{step}.pt", step)
        oldest = f"run/step_{step - kept}.pt"
        wait_for(
            lambda: (
                any(e.get("deleted") for e in daemon.events("prune.finished")[-1:])
                and daemon.events("prune.deleted", path=oldest)
            ),
            300,
            f"{oldest} pruned",
            context=lambda: daemon.log_text()[-3000:],
        )

    with daemon:
        wait_for(lambda: len(daemon.events("copy.committed")) >= kept, 600, f"the first {kept} checkpoints mirrored")
        pruned(kept)
        before = counts(sent)
        for step in range(kept + 1, kept + 1 + measured):
            pruned(step)
        after = counts(sent)
    per = {op: (after[op] - before[op]) / measured for op in sorted(after) if after[op] > before[op]}
    return per, len(daemon.events("prune.deleted"))


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    if argv[1:2] != ["-m"]:
        raise SystemExit("usage: python -m tests.support.s3requests OUT PYTHON -m MODULE ARGS...")
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(event_name: str, **_: Any) -> None:
        os.write(fd, event_name.rsplit(".", 1)[-1].encode() + b"\n")  # one write: lines never interleave

    import botocore.session

    create = botocore.session.Session.create_client

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = create(self, *args, **kwargs)
        client.meta.events.register("before-send.s3", record)
        return client

    botocore.session.Session.create_client = counted  # type: ignore[method-assign]
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
