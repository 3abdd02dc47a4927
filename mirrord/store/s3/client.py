"""How an object-store mirror's client is made, and its errors in mirrord's typed tree (where the mirror lives,
S3Location, is on the ground floor: mirrord.paths)."""

from __future__ import annotations

import socket
import time
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from mirrord.config import S3Config
from mirrord.errors import MirrordError, PermanentError, UnreachableError

try:
    from botocore.exceptions import BotoCoreError, ClientError
except ImportError:  # pragma: no cover - without the s3 extra open_s3_mirror refuses before any call

    class BotoCoreError(Exception):  # type: ignore[no-redef]
        """Stands in for botocore's: nothing raises it without botocore."""

    class ClientError(Exception):  # type: ignore[no-redef]
        """Stands in for botocore's: nothing raises it without botocore."""


S3_ERRORS = (ClientError, BotoCoreError)  # what a call of the client raises besides our own MirrordError
MIB = 1024 * 1024

# Client-side errors that mean "try again" rather than "fix something": throttling, server trouble, and
# bytes that arrived other than the checksum we computed from them says (a new try sends them again).
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestTimeTooSkewed",
        "OperationAborted",
        "500",
        "502",
        "503",
        "504",
        "BadDigest",
    }
)
# A conditional write that lost: another writer changed the object since we read its ETag.
CONFLICT_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


# The mirror's settings are the [s3] section itself (validated, frozen, with the same defaults).
S3Settings = S3Config


def node_name(configured: str) -> str:
    """This node's name in a shared prefix: s3.node, or the host's name."""
    return configured or socket.gethostname()


def make_session(settings: S3Settings) -> Any:
    """A boto3 session: the credential chain (or the inline key pair), and botocore's loaded S3 model,
    shared by every client made from it (loading that model is most of a client's start-up cost)."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=settings.access_key_id, aws_secret_access_key=settings.secret_access_key
    )


def make_client(
    settings: S3Settings, timeout: float | None = None, attempts: int | None = None, session: Any = None
) -> Any:
    """A botocore S3 client whose every request gives up within `timeout` (s3.timeout_seconds unless
    given): each try may wait a third of it (all of it when there is one try), and a retry (standard
    mode: throttling, 5xx, a refused connection while a server restarts) starts only while a whole try
    still fits before that deadline.
    Made from `session` when given (the mirror's: its clients share one loaded model)."""
    from botocore.config import Config as BotoConfig

    session = session if session is not None else make_session(settings)
    deadline = timeout or settings.timeout_seconds
    attempts = attempts or settings.max_attempts
    per_try = deadline if attempts == 1 else max(1.0, deadline / 3)
    config = BotoConfig(
        region_name=settings.region,
        # Unsigned payload (what botocore does over https anyway): every body still carries the CRC32 the
        # server checks. Signing adds a SHA-256 pass over every byte sent over plain http (s3.sign_payload).
        s3={
            "addressing_style": settings.addressing_style,
            **({} if settings.sign_payload else {"payload_signing_enabled": False}),
        },
        retries={"mode": "standard", "max_attempts": attempts},
        max_pool_connections=max(10, settings.concurrency + settings.files_in_flight + 4),  # parts + files
        connect_timeout=per_try,
        read_timeout=per_try,
    )
    client = session.client("s3", endpoint_url=settings.endpoint_url, config=config)
    events = client.meta.events

    def started(context: dict[str, Any], **_: Any) -> None:
        context["mirrord_deadline"] = time.monotonic() + deadline

    def out_of_time(request_dict: dict[str, Any], **_: Any) -> bool | None:
        """False (no retry) once another whole try would end past the deadline; None lets botocore decide."""
        ends = request_dict.get("context", {}).get("mirrord_deadline")
        return False if ends is not None and time.monotonic() + per_try > ends else None

    def not_s3(http_response: Any, parsed: dict[str, Any], model: Any, **_: Any) -> None:
        """An error with no S3 error document (an HTML page, a bare status) to a request whose answer would
        carry one: another service answers at the endpoint. Said naming it and what answered, where botocore
        would report a bare "404 Not Found" or "501 Not Implemented"."""
        error, status = parsed.get("Error", {}), http_response.status_code
        if status < 400 or model.http["method"] == "HEAD" or not str(error.get("Code", "")).isdigit():
            return
        if str(status) in TRANSIENT_CODES:  # a proxy's 5xx page while the server restarts: a later try may do
            return
        server = http_response.headers.get("server")
        raise PermanentError(
            client.meta.endpoint_url,
            f"not an S3 endpoint: it answered {model.http['method']} {urlsplit(http_response.url).path} "
            f"with {status} {error.get('Message', '')}".rstrip()
            + (f" ({server})" if server else "")
            + " and no S3 error; check s3.endpoint_url",
        )

    events.register("before-call.s3", started)
    events.register_first("needs-retry.s3", out_of_time)
    events.register("after-call.s3", not_s3)
    return client


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore exception (its HTTP status without one; '' if it has neither)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    code = response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(code or "")


def wrap(where: str, exc: Exception, action: str) -> MirrordError:
    """A botocore error as one line in the typed tree: transient if a later try may succeed. Credentials
    missing or refused say what to fix; a connection error keeps botocore's own words, which name the
    endpoint and what happened (refused, timed out). Every command and the daemon say it the same way."""
    from botocore.exceptions import NoCredentialsError

    if isinstance(exc, MirrordError):
        return exc
    code = error_code(exc)
    if isinstance(exc, NoCredentialsError):
        return PermanentError(
            where,
            f"{action}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE, or give the machine a role (the standard AWS chain)",
        )
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return PermanentError(
            where,
            f"{action}: the server refused the credentials ({code}): check AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY (or the profile), and their rights on the bucket",
        )
    message = exc.response.get("Error", {}).get("Message", "") if isinstance(exc, ClientError) else str(exc)
    inner = getattr(exc, "kwargs", {}).get("error")  # a connection error's own: "[Errno 111] Connection refused"
    if inner is not None:
        message = f"{message} ({str(inner).rpartition(': ')[2]})"
    cause = f"{action}: {code + ' ' if code else ''}{message or type(exc).__name__}".strip()
    if isinstance(exc, ClientError) and code not in TRANSIENT_CODES:
        return PermanentError(where, cause)
    if inner is not None:
        cause = f"no answer from the S3 endpoint ({cause}): check s3.endpoint_url and that the server is up"
    return UnreachableError(where, cause)  # connection errors, timeouts, throttling, 5xx


def get_object(client: Any, bucket: str, key: str) -> tuple[bytes, str] | None:
    """The object's bytes and ETag; None if there is none (any other failure raises botocore's error)."""
    try:
        answer = client.get_object(Bucket=bucket, Key=key)
        return answer["Body"].read(), str(answer["ETag"])
    except S3_ERRORS as exc:
        if error_code(exc) in MISSING_CODES:
            return None
        raise


def put_if(client: Any, bucket: str, key: str, body: bytes, etag: str | None) -> str | None:
    """PUT a JSON body only if the object is still `etag` (If-Match; None: only if there is none yet,
    If-None-Match: *): the new ETag, or None when another writer changed it first."""
    condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
    try:
        answer = client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json", **condition)
    except S3_ERRORS as exc:
        if error_code(exc) in CONFLICT_CODES:
            return None
        raise
    return str(answer["ETag"])


def server_time(answer: dict[str, Any]) -> float | None:
    """The server's clock from an answer's Date header (seconds since the epoch), None without one: ages
    of objects and uploads are measured on the clock that stamped them."""
    from email.utils import parsedate_to_datetime

    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None


def ns(when: datetime) -> int:
    """A LastModified as nanoseconds since the epoch."""
    return int(when.timestamp()) * 10**9 + when.microsecond * 1000
