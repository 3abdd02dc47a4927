"""S3 errors in mirrord's typed tree: which botocore errors are worth retrying, and their codes."""

from __future__ import annotations

from mirrord.errors import MirrordError, PermanentError, TransientError

# Client-side errors that mean "try again" rather than "fix something": throttling, server trouble.
TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                              "ThrottlingException", "RequestTimeTooSkewed", "OperationAborted", "500", "502",
                              "503", "504",
                              # The bytes arrived other than the checksum we computed from them says: a new
                              # try sends them again.
                              "BadDigest"})


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore exception ('' if it has none)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(status or "")
    return ""


def wrap(where: str, exc: Exception, action: str) -> MirrordError:
    """A botocore error as one line in the typed tree: transient if a later try may succeed."""
    from botocore.exceptions import ClientError

    if isinstance(exc, MirrordError):
        return exc
    code = error_code(exc)
    message = exc.response.get("Error", {}).get("Message", "") if isinstance(exc, ClientError) else str(exc)
    cause = f"{action}: {code + ' ' if code else ''}{message or type(exc).__name__}".strip()
    if isinstance(exc, ClientError) and code not in TRANSIENT_CODES:
        return PermanentError(where, cause)
    return TransientError(where, cause)  # connection errors, timeouts, throttling, 5xx



def access_error(where: str, exc: Exception) -> MirrordError:
    """Why the bucket cannot be used, in words that say what to fix: credentials missing or refused, or a
    server that does not answer (before, each read as "does not exist")."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, NoCredentialsError

    code = error_code(exc)
    if isinstance(exc, NoCredentialsError):
        return PermanentError(where, "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                     "or AWS_PROFILE, or give the machine a role (the standard AWS chain)")
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return PermanentError(where, f"the server refused the credentials ({code}): check AWS_ACCESS_KEY_ID "
                                     "and AWS_SECRET_ACCESS_KEY (or the profile), and their rights on the bucket")
    if isinstance(exc, EndpointConnectionError | ConnectTimeoutError):
        return TransientError(where, f"no answer from the S3 endpoint ({exc}): check s3.endpoint_url and that "
                                     "the server is up")
    return wrap(where, exc, "head bucket")
# A conditional write that lost: another writer changed the object since we read its ETag.
CONFLICT_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
