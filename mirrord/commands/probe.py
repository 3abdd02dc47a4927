"""`check-config --probe`: reach the mirror as the daemon does, write a test object, read it back and delete
it; what is wrong, in one line (the endpoint, the credentials, the rights, the folder)."""

from __future__ import annotations

import os
from typing import Any

from mirrord.errors import PermanentError
from mirrord.store.atomic import write_bytes_atomic

PROBE = ".mirrord-probe"  # a hidden name: no scan or listing of checkpoints ever sees it


def probe_mirror(mirror: Any, is_s3: bool) -> str:
    """What was done; else a MirrordError naming the step that failed and why."""
    if not mirror.exists():  # an S3 mirror that cannot be reached or used raises here, saying why
        raise PermanentError(mirror.describe(), "does not exist (mirror / --mirror)")
    body, name, step = f"mirrord probe {os.getpid()}\n".encode(), f"{PROBE}-{os.getpid()}", "write"
    where = mirror.describe(name)
    if is_s3:
        from mirrord.store.s3.client import S3_ERRORS, wrap

        client, bucket, key = mirror.client, mirror.location.bucket, mirror.location.key(name)
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body)
            step = "read back"
            got = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            step = "delete"
            client.delete_object(Bucket=bucket, Key=key)
        except S3_ERRORS as exc:
            raise wrap(where, exc, step) from exc
    else:
        path = mirror.root / name
        try:
            write_bytes_atomic(path, body)  # the protocol every copy goes through: temp, fsync, rename, fsync
            step = "read back"
            got = path.read_bytes()
            step = "delete"
            path.unlink()
        except OSError as exc:
            raise PermanentError(where, f"{step}: {exc.strerror or exc}") from exc
    if got != body:
        raise PermanentError(where, f"read back {len(got)} bytes that differ from the {len(body)} written")
    return f"wrote, read back and deleted {where}"
