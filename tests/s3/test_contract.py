"""The storage seam's contract (tests/unit/test_mirror_contract.py) run against the object-store mirror
on a real S3 server: the same tests, only `mirror_store` differs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.unit.test_mirror_contract import *  # noqa: F403 - the contract's tests, collected here too
from tests.unit.test_mirror_contract import MirrorFactory


@pytest.fixture
def mirror_store(seaweed: SeaweedServer, bucket: str, prefix: str) -> Iterator[MirrorFactory]:
    """Handles on one fresh prefix of the session's bucket (overrides the contract's local-only fixture)."""
    url = f"s3://{bucket}/{prefix}"
    yield lambda: S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
