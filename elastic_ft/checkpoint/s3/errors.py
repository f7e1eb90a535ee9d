"""What an S3 failure means: retry it, or map it to the store errors of :mod:`elastic_ft.checkpoint.errors`.

:func:`is_transient` decides what the retry policy retries (throttling,
5xx, dropped/reset/timed-out connections, truncated bodies);
:func:`client_error` turns what is left into a domain error naming the
object. Only a 404 says something about the object (:class:`ObjectNotFound`);
everything else (access denied, expired or missing credentials, no such
bucket, an error nobody classified) is :class:`StoreUnavailable`: the store
did not answer, so nothing may be concluded about the object. Messages carry
the error code, never headers or credentials.
"""

from __future__ import annotations

import http.client

from elastic_ft.checkpoint.errors import ObjectNotFound, StoreError, StoreUnavailable

# Error codes S3 and compatible servers use for "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "BadDigest",  # the body was damaged on the way in; sending it again is the fix
        "IncompleteBody",
        "XAmzContentSHA256Mismatch",
    }
)

# Error codes for credentials that were valid once and have run out.
_EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "RequestExpired"})

# Error codes for a request the server refused to serve with these credentials.
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "InvalidSecurity",
    }
)


class TruncatedBody(Exception):
    """A response body shorter than its Content-Length or requested range (retried)."""


class ObjectChanged(Exception):
    """The object was overwritten between the parts of one download (restart the download)."""


def status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ``ClientError`` (None for other errors)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` ('' for other errors)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: throttling, 5xx, connection trouble or a truncated body."""
    from botocore import exceptions as bexc

    if isinstance(exc, TruncatedBody):
        return True
    if isinstance(exc, bexc.ClientError):
        st = status(exc)
        return code(exc) in _TRANSIENT_CODES or st == 429 or (st is not None and st >= 500)
    # ConnectionError covers EndpointConnectionError, ConnectionClosedError,
    # ReadTimeoutError and ConnectTimeoutError; HTTPClientError covers the
    # rest of urllib3's transport failures as botocore wraps them.
    if isinstance(
        exc,
        (
            bexc.ConnectionError,
            bexc.HTTPClientError,
            bexc.IncompleteReadError,
            bexc.ResponseStreamingError,
        ),
    ):
        return True
    # Raw transport errors that escape botocore while a body is being read.
    import urllib3.exceptions

    return isinstance(
        exc, (urllib3.exceptions.HTTPError, http.client.HTTPException, ConnectionError, TimeoutError)
    )


def describe(exc: BaseException) -> str:
    """A one-line description of an error for logs and messages (no headers, no credentials)."""
    c, st = code(exc), status(exc)
    if c or st:
        return f"{c or 'HTTP error'} (HTTP {st})"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def client_error(what: str, uri: str, bucket: str, exc: BaseException) -> StoreError:
    """The domain error for a non-transient failure of operation ``what`` on object ``uri`` (see the module docstring)."""
    from botocore import exceptions as bexc

    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, bexc.ClientError):
        return _from_client_error(what, uri, bucket, exc)
    if isinstance(exc, bexc.NoCredentialsError):
        return StoreUnavailable(
            f"S3 {what} of {uri} failed: no AWS credentials were found; "
            "set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    return StoreUnavailable(
        f"S3 {what} of {uri} failed: {describe(exc)}; check the endpoint, credentials and network, then retry"
    )


def _from_client_error(what: str, uri: str, bucket: str, exc: BaseException) -> StoreError:
    c, st = code(exc), status(exc)
    if c in ("NoSuchKey", "NotFound") or (st == 404 and c != "NoSuchBucket"):
        return ObjectNotFound(f"{uri} does not exist")
    if c == "NoSuchBucket":
        return StoreUnavailable(f"S3 {what} of {uri} failed: bucket {bucket!r} does not exist; create it first")
    if c in _EXPIRED_CODES:
        return StoreUnavailable(
            f"S3 {what} of {uri} was refused ({c}): the credentials have expired; "
            "refresh them (e.g. aws sso login, or a new session token) and retry"
        )
    if c in _REFUSED_CODES or st == 403:
        return StoreUnavailable(
            f"S3 {what} of {uri} was refused ({c or 'HTTP 403'}); check the credentials and the bucket policy"
        )
    return StoreUnavailable(
        f"S3 {what} of {uri} failed: {describe(exc)}; check the endpoint and the server's logs, then retry"
    )


__all__ = ["ObjectChanged", "TruncatedBody", "client_error", "code", "describe", "is_transient", "status"]
