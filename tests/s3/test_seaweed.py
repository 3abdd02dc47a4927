"""The S3 server the object-store tests rely on behaves like S3 where mirrord depends on it."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code"))


def test_conditional_put_and_hidden_multipart(s3_client: Any, bucket: str, prefix: str) -> None:
    first = s3_client.put_object(Bucket=bucket, Key=f"{prefix}/m", Body=b"one", IfNoneMatch="*")
    with pytest.raises(ClientError) as exists:
        s3_client.put_object(Bucket=bucket, Key=f"{prefix}/m", Body=b"two", IfNoneMatch="*")
    assert _code(exists.value) == "PreconditionFailed"
    with pytest.raises(ClientError) as stale:
        s3_client.put_object(Bucket=bucket, Key=f"{prefix}/m", Body=b"two", IfMatch='"0123"')
    assert _code(stale.value) == "PreconditionFailed"
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/m", Body=b"two", IfMatch=first["ETag"])
    assert s3_client.get_object(Bucket=bucket, Key=f"{prefix}/m")["Body"].read() == b"two"

    upload = s3_client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/big")
    part = s3_client.upload_part(
        Bucket=bucket,
        Key=f"{prefix}/big",
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=b"x" * (5 << 20),
        ChecksumAlgorithm="CRC32",
    )
    with pytest.raises(ClientError):
        s3_client.head_object(Bucket=bucket, Key=f"{prefix}/big")  # invisible until complete
    listed = s3_client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", [])
    assert [u["Key"] for u in listed] == [f"{prefix}/big"]
    s3_client.abort_multipart_upload(Bucket=bucket, Key=f"{prefix}/big", UploadId=upload["UploadId"])
    assert s3_client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", []) == []
    assert part["ChecksumCRC32"]
