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
