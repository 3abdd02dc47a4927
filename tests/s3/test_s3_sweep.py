"""The stale-upload sweep against a real S3 server: work in flight is never "stale". The sweep knows this
process's own uploads, and ages come from one clock, the server's (issue 33, case 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.support.faketime import faketime_env
from tests.support.wait import wait_for

PART = 5 * 1024 * 1024  # S3's smallest part


def _pending(s3_client: Any, bucket: str, prefix: str) -> list[str]:
    answer = s3_client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/")
    return [up["Key"] for up in answer.get("Uploads", ())]


def test_the_sweep_never_aborts_an_upload_of_its_own_in_flight(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str
) -> None:
    """A multipart upload of this process that has run longer than the age guard (here 1 s: any upload
    lasting past prune.min_age_seconds) is left alone by this process's sweep, and completes whole
    afterwards. Another process's view calls it old: only its owner knows it is alive."""
    url = f"s3://{bucket}/{prefix}"
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, part_size=PART))
    data = os.urandom(3 * PART)
    upload = mirror.begin_upload("run/step_1.pt", len(data))
    upload.write(memoryview(data)[: 2 * PART])
    upload._parts[0].result()  # the upload exists on the server and a part is in
    onlooker = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    wait_for(lambda: onlooker.stale_uploads(older_than=1), 60, "the upload to be older than the age guard")

    assert mirror.sweep_stale_uploads(older_than=1) == 0
    assert _pending(s3_client, bucket, prefix) == [f"{prefix}/run/step_1.pt"]
    upload.write(memoryview(data)[2 * PART :])
    upload.seal(0)
    upload.commit()
    with mirror.open_read("run/step_1.pt") as stream:
        assert stream.read() == data
    assert _pending(s3_client, bucket, prefix) == []


def test_a_local_clock_ahead_of_the_server_ages_no_upload(
    seaweed: SeaweedServer, s3_client: Any, bucket: str, prefix: str, s3_env: dict[str, str]
) -> None:
    """Another writer's upload started a moment ago; the sweeping process runs 10 minutes ahead of the
    server's clock (faketime on that process only), past a 300 s age guard. The upload is young by the
    server's clock, which stamped it: nothing is aborted."""
    key = f"{prefix}/run/step_2.pt"
    s3_client.create_multipart_upload(Bucket=bucket, Key=key)
    child = textwrap.dedent(f"""
        import time
        from mirrord.store.s3 import S3Mirror, S3Settings
        mirror = S3Mirror("s3://{bucket}/{prefix}", S3Settings(endpoint_url={seaweed.endpoint!r}))
        print("swept", round(time.time()), mirror.sweep_stale_uploads(older_than=300), flush=True)
    """)
    env = {**os.environ, **s3_env, **faketime_env("+10m")}
    done = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("swept "))
    skewed, swept = (int(word) for word in line.split()[1:])
    assert skewed - time.time() > 500  # the child's clock really was ahead
    assert swept == 0
    assert _pending(s3_client, bucket, prefix) == [key]
