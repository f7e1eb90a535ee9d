"""The ``s3://bucket/prefix`` object store: boto3 behind the narrow ``ObjectStore`` interface.

What this adds over a plain ``put_object``/``get_object``:

- **Conditional create.** ``put(..., if_absent=True)`` sends ``If-None-Match: *``
  (on ``PutObject``, or on ``CompleteMultipartUpload`` for large objects); a 412
  becomes :class:`ObjectExists`. A retried conditional put whose first attempt
  was committed but whose response was lost also answers 412: the store cannot
  tell that apart and raises :class:`ObjectExists`; the manifest writer re-reads
  the object and compares its writer token.
- **Large objects.** At ``multipart_threshold`` bytes and above, a put is a
  multipart upload whose parts go up in parallel and which is aborted if any
  part finally fails (so no invisible parts are left to bill). A download of
  known size (``get_verified``: the manifest gives it) sends the first ranged
  GET and, as soon as its Content-Range total has matched that size (else
  :class:`BlobMismatch`, before anything of the claimed size is allocated),
  the others, at most ``2 * max_concurrency`` in flight; ``get`` fetches
  the first ``download_part_size`` bytes, learns the size from
  Content-Range and fetches the rest pinned to that ETag (``If-Match``). The
  answers must agree on the ETag, so an overwrite during a download restarts
  it instead of mixing two versions. The ranges are read straight into one
  anonymous mapping of the object's size, returned as a writable
  ``memoryview`` (the reader views tensors in it without another copy).
  ``get_verified`` hashes while downloading: a chunked digest
  (:mod:`elastic_ft.checkpoint.digest`) in the worker that fetched each range,
  a plain one in order as the ranges arrive.
- **Retries.** Every request is retried by one tenacity policy (bounded
  exponential backoff with jitter, ``max_attempts`` in all) on throttling
  (SlowDown, 503, 429), other 5xx, dropped/reset/timed-out connections and
  truncated bodies. Each retry is logged at WARNING with the object's URI and
  the error (never credentials). When attempts run out,
  :class:`StoreUnavailable` states the count and the key. botocore's own
  retries are switched off in the clients this module builds, so this policy
  is the one in force; a client passed in keeps whatever retry settings its
  owner gave it.
- **Errors.** A 404 is :class:`ObjectNotFound`; an object whose size or
  digest differs from the manifest's, as the server consistently answers, is
  :class:`BlobMismatch`. Everything else that stops a request (retries run
  out, AccessDenied/403, expired or missing credentials, no such bucket, an
  error nobody classified) is :class:`StoreUnavailable`: the store could not
  answer, and callers must not conclude anything about the object.
- **Configuration.** Endpoint, region, credentials and profiles come from the
  usual boto3 sources (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
  ``AWS_PROFILE``, ``~/.aws/config``); nothing here overrides them unless the
  caller passes ``endpoint_url`` or ``profile``. Server-side encryption:

  ``ELASTIC_FT_S3_SSE``
      ``AES256`` (SSE-S3), ``aws:kms`` (SSE-KMS) or ``none``. Constructor
      argument ``sse`` wins over it.
  ``ELASTIC_FT_S3_SSE_KMS_KEY_ID``
      KMS key id/ARN/alias for SSE-KMS; setting it alone implies ``aws:kms``.
      Constructor argument ``sse_kms_key_id`` wins over it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import http.client
import logging
import mmap
import os
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from elastic_ft.checkpoint.digest import BlobDigest
from elastic_ft.checkpoint.segments import Data, Segments, as_segments
from elastic_ft.checkpoint.errors import BlobMismatch, ObjectExists, ObjectNotFound, StoreError, StoreUnavailable
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore, check_key

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20

#: Environment variables read when the constructor is not told (documented above).
ENV_SSE = "ELASTIC_FT_S3_SSE"
ENV_SSE_KMS_KEY_ID = "ELASTIC_FT_S3_SSE_KMS_KEY_ID"

_SSE_CHOICES = ("AES256", "aws:kms")

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


class _TruncatedBody(Exception):
    """A response body shorter than its Content-Length or requested range (retried)."""


class _ObjectChanged(Exception):
    """The object was overwritten between the parts of one download (restart the download)."""


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: throttling, 5xx, connection trouble or a truncated body."""
    from botocore import exceptions as bexc

    if isinstance(exc, _TruncatedBody):
        return True
    if isinstance(exc, bexc.ClientError):
        status = _status(exc)
        return _code(exc) in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500)
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


def _describe(exc: BaseException) -> str:
    """A one-line description of an error for logs and messages (no headers, no credentials)."""
    code = _code(exc)
    status = _status(exc)
    if code or status:
        return f"{code or 'HTTP error'} (HTTP {status})"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into ``("bucket", "some/prefix/")``.

    The prefix is empty or ends with one '/', so keys join without doubling it.
    """
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme.lower() != "s3":
        raise StoreError(f"{uri!r} is not an S3 URI; write it as s3://bucket/prefix")
    if not parsed.netloc:
        raise StoreError(f"S3 URI {uri!r} names no bucket; write it as s3://bucket/prefix")
    if parsed.query or parsed.fragment:
        raise StoreError(f"S3 URI {uri!r} has a query or fragment; write it as s3://bucket/prefix")
    prefix = parsed.path.strip("/")
    if "//" in parsed.path.rstrip("/"):
        raise StoreError(f"S3 URI {uri!r} has an empty path segment ('//'); remove it")
    return parsed.netloc, (prefix + "/" if prefix else "")


def _sse_args(sse: str | None, kms_key_id: str | None) -> dict[str, str]:
    """The ``ServerSideEncryption`` arguments for puts, from arguments or the environment."""
    if sse is None:
        sse = os.environ.get(ENV_SSE) or None
    if kms_key_id is None:
        kms_key_id = os.environ.get(ENV_SSE_KMS_KEY_ID) or None
    if sse is not None and sse.lower() == "none":
        if kms_key_id:
            raise StoreError(
                f"S3 server-side encryption is 'none' but a KMS key id ({kms_key_id!r}) is set; "
                f"unset {ENV_SSE_KMS_KEY_ID} or choose sse='aws:kms'"
            )
        return {}
    if sse is None and kms_key_id:
        sse = "aws:kms"
    if sse is None:
        return {}
    if sse not in _SSE_CHOICES:
        raise StoreError(
            f"S3 server-side encryption {sse!r} is not supported; use 'AES256' (SSE-S3), "
            f"'aws:kms' (SSE-KMS) or 'none' (argument sse or {ENV_SSE})"
        )
    if sse == "AES256" and kms_key_id:
        raise StoreError(
            f"S3 server-side encryption 'AES256' takes no KMS key id, but {kms_key_id!r} is set; "
            "use sse='aws:kms' to encrypt with that key"
        )
    args = {"ServerSideEncryption": sse}
    if kms_key_id:
        args["SSEKMSKeyId"] = kms_key_id
    return args


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix/``; see the module docstring for behaviour.

    Args:
        bucket: the bucket name.
        prefix: the key prefix of this store's root ('' or ending in '/').
        client: a boto3 S3 client to use; by default one is built from the
            standard boto3 configuration with botocore's retries off.
        uri: the URI for messages (default ``s3://bucket/prefix``).
        endpoint_url: override the endpoint (default: boto3's, which honours
            ``AWS_ENDPOINT_URL_S3`` and ``AWS_ENDPOINT_URL``).
        profile: a named AWS profile (default: boto3's, i.e. ``AWS_PROFILE``).
        region: a region name (default: boto3's).
        sse: ``'AES256'``, ``'aws:kms'`` or ``'none'`` (default: ``ELASTIC_FT_S3_SSE``).
        sse_kms_key_id: KMS key for SSE-KMS (default: ``ELASTIC_FT_S3_SSE_KMS_KEY_ID``).
        multipart_threshold: puts of this many bytes or more use multipart upload.
        part_size: multipart part size (S3 requires at least 5 MiB but the last).
        download_part_size: size of each ranged GET of a download.
        max_concurrency: parts uploaded / ranged GETs in flight per store (default:
            3 per CPU this process may use, at most boto3's 10).
        max_attempts: attempts per request, the first included.
        backoff_initial, backoff_max: exponential backoff bounds in seconds.
        connect_timeout, read_timeout: socket timeouts of the built client.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        uri: str | None = None,
        endpoint_url: str | None = None,
        profile: str | None = None,
        region: str | None = None,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        # 8 MiB threshold and parts (boto3 upload_file/download_file defaults): measured by
        # bench/checkpoint.py against SeaweedFS, 16 MiB ranged GETs loaded a
        # 300 MB checkpoint at 0.72x boto3's speed and 8 MiB ones at 0.93-0.96x.
        multipart_threshold: int = 8 * MiB,
        part_size: int = 8 * MiB,
        download_part_size: int = 8 * MiB,
        max_concurrency: int | None = None,
        max_attempts: int = 6,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        if max_concurrency is None:
            max_concurrency = default_concurrency()
        problems = []
        if part_size < 5 * MiB:
            problems.append(f"The multipart part size ({part_size}) must be at least 5 MiB ({5 * MiB}), S3's minimum.")
        if multipart_threshold < part_size:
            problems.append(
                f"The multipart threshold ({multipart_threshold}) must be at least the part size ({part_size})."
            )
        if download_part_size < 1:
            problems.append(f"The download part size ({download_part_size}) must be positive.")
        if max_concurrency < 1:
            problems.append(f"The concurrency ({max_concurrency}) must be at least 1.")
        if max_attempts < 1:
            problems.append(f"The attempt count ({max_attempts}) must be at least 1.")
        if not 0 < backoff_initial <= backoff_max:
            problems.append(f"The backoff bounds ({backoff_initial}, {backoff_max}) must satisfy 0 < initial <= max.")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if problems:
            raise StoreError("S3 store for s3://%s/%s is misconfigured: %s" % (bucket, prefix, " ".join(problems)))
        self.bucket = bucket
        self.prefix = prefix
        self.uri = uri or f"s3://{bucket}/{prefix}".rstrip("/")
        self.sse_args = _sse_args(sse, sse_kms_key_id)
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.download_part_size = download_part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._owns_client = client is None
        if client is None:
            client = _make_client(
                endpoint_url=endpoint_url,
                profile=profile,
                region=region,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # Each parallel part holds one pooled connection; leave room for the caller.
                pool_size=max(10, 2 * max_concurrency),
            )
        self.client = client
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> S3Store:
        """Open ``s3://bucket/prefix``; keyword arguments as for the constructor."""
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket, prefix, uri=uri.rstrip("/"), **kwargs)

    # -- plumbing ---------------------------------------------------------------

    def _s3key(self, key: str) -> str:
        check_key(key)
        return self.prefix + key

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix="s3store"
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._owns_client and hasattr(self.client, "close"):
            self.client.close()  # its connection pool; a client passed in is its owner's to close

    def _retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request under the retry policy.

        ``what`` names the operation for logs ("put", "get part 3", ...). A
        non-transient error is raised at once, unchanged, for the caller to map.
        """
        import tenacity

        uri = self.join(key)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "S3 %s of %s failed (attempt %d of %d: %s); retrying in %.2f s",
                what,
                uri,
                state.attempt_number,
                self.max_attempts,
                _describe(exc) if exc else "unknown error",
                state.next_action.sleep if state.next_action else 0.0,
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            # initial * 2**n capped at max, plus up to ``initial`` of jitter so
            # parallel parts that failed together do not retry in lockstep.
            # (Spelled with the two classic waits: wait_exponential_jitter's
            # arguments changed between tenacity 8 and 9.)
            wait=tenacity.wait_exponential(multiplier=self.backoff_initial, max=self.backoff_max)
            + tenacity.wait_random(0, self.backoff_initial),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            if is_transient(exc):
                attempts = retrying.statistics.get("attempt_number", self.max_attempts)
                raise StoreUnavailable(
                    f"S3 {what} of {uri} failed after {attempts} attempts; last error: {_describe(exc)}. "
                    "Check the endpoint, network and server health, or raise max_attempts."
                ) from exc
            raise

    def _client_error(self, what: str, key: str, exc: BaseException) -> StoreError:
        """Map a non-transient boto3 error to a domain error naming the object.

        Only a 404 says something about the object (:class:`ObjectNotFound`);
        everything else (access denied, expired or missing credentials, no such
        bucket, an error nobody classified) is :class:`StoreUnavailable`: the
        store did not answer, so nothing may be concluded about the object.
        Messages carry the error code, never credentials.
        """
        from botocore import exceptions as bexc

        uri = self.join(key)
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, bexc.ClientError):
            code, status = _code(exc), _status(exc)
            if code in ("NoSuchKey", "NotFound") or (status == 404 and code != "NoSuchBucket"):
                return ObjectNotFound(f"{uri} does not exist")
            if code == "NoSuchBucket":
                return StoreUnavailable(
                    f"S3 {what} of {uri} failed: bucket {self.bucket!r} does not exist; create it first"
                )
            if code in _EXPIRED_CODES:
                return StoreUnavailable(
                    f"S3 {what} of {uri} was refused ({code}): the credentials have expired; "
                    "refresh them (e.g. aws sso login, or a new session token) and retry"
                )
            if code in _REFUSED_CODES or status == 403:
                return StoreUnavailable(
                    f"S3 {what} of {uri} was refused ({code or 'HTTP 403'}); "
                    "check the credentials and the bucket policy"
                )
            return StoreUnavailable(
                f"S3 {what} of {uri} failed: {_describe(exc)}; check the endpoint and the server's logs, then retry"
            )
        if isinstance(exc, bexc.NoCredentialsError):
            return StoreUnavailable(
                f"S3 {what} of {uri} failed: no AWS credentials were found; "
                "set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
        return StoreUnavailable(
            f"S3 {what} of {uri} failed: {_describe(exc)}; check the endpoint, credentials and network, then retry"
        )

    # -- put --------------------------------------------------------------------

    def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        s3key = self._s3key(key)
        segments = as_segments(data)
        try:
            if len(segments) >= self.multipart_threshold:
                self._put_multipart(key, s3key, segments, if_absent)
            else:
                self._put_single(key, s3key, segments.tobytes(), if_absent)
        except StoreError:
            raise
        except Exception as exc:
            if if_absent and _status(exc) == 412:
                raise ObjectExists(
                    f"{self.join(key)} already exists (if this put was retried after a lost answer, "
                    "it may be this writer's own object: read it back and compare before giving up)"
                ) from exc
            raise self._client_error("put", key, exc) from exc

    def _put_single(self, key: str, s3key: str, body: bytes, if_absent: bool) -> None:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": s3key, "Body": body, **self.sse_args}
        if if_absent:
            args["IfNoneMatch"] = "*"
        self._retry("put", key, lambda: self.client.put_object(**args))

    def _put_multipart(self, key: str, s3key: str, segments: Segments, if_absent: bool) -> None:
        # Mirror boto3's own upload_file (s3transfer): when the client computes
        # checksums by default, declare CRC32 for the upload and hand every
        # part's checksum back on completion, so S3 verifies each part's bytes.
        checksum = getattr(self.client.meta.config, "request_checksum_calculation", None) == "when_supported"
        extra = {"ChecksumAlgorithm": "CRC32"} if checksum else {}
        created = self._retry(
            "multipart create",
            key,
            lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=s3key, **self.sse_args, **extra),
        )
        upload_id = created["UploadId"]
        try:
            # S3 allows at most 10,000 parts: grow the part size for huge objects.
            part_size = max(self.part_size, -(-len(segments) // 10_000))
            offsets = list(range(0, len(segments), part_size))

            def upload(number: int, offset: int) -> dict[str, Any]:
                # Gathered in the worker: at most max_concurrency parts in memory at once.
                body = segments.read(offset, part_size)
                out = self._retry(
                    f"upload part {number}",
                    key,
                    lambda: self.client.upload_part(
                        Bucket=self.bucket, Key=s3key, UploadId=upload_id, PartNumber=number, Body=body, **extra
                    ),
                )
                part = {"PartNumber": number, "ETag": out["ETag"]}
                if checksum and "ChecksumCRC32" in out:
                    part["ChecksumCRC32"] = out["ChecksumCRC32"]
                return part

            pool = self._executor()
            futures = [pool.submit(upload, n, off) for n, off in enumerate(offsets, start=1)]
            try:
                parts = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                concurrent.futures.wait(futures)
                raise
            complete: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": s3key,
                "UploadId": upload_id,
                "MultipartUpload": {"Parts": parts},
            }
            if if_absent:
                complete["IfNoneMatch"] = "*"

            def finish() -> Any:
                try:
                    return self.client.complete_multipart_upload(**complete)
                except Exception as exc:
                    # A retried complete whose first attempt succeeded finds the
                    # upload gone; if the object is there with our part count the
                    # upload did commit.
                    if _code(exc) == "NoSuchUpload" and self._committed_multipart(s3key, len(parts)):
                        return None
                    raise

            self._retry("multipart complete", key, finish)
        except BaseException as exc:
            self._abort(key, s3key, upload_id, exc)
            raise

    def _committed_multipart(self, s3key: str, part_count: int) -> bool:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=s3key)
        except Exception:
            return False
        return str(head.get("ETag", "")).strip('"').endswith(f"-{part_count}")

    def _abort(self, key: str, s3key: str, upload_id: str, cause: BaseException) -> None:
        """Abort a failed multipart upload so its parts do not linger (and cost)."""
        try:
            self._retry(
                "multipart abort",
                key,
                lambda: self.client.abort_multipart_upload(Bucket=self.bucket, Key=s3key, UploadId=upload_id),
            )
        except Exception as exc:
            if _code(exc) == "NoSuchUpload":
                return  # already completed or aborted
            log.warning(
                "could not abort the failed multipart upload %s of %s (%s) after: %s; "
                "a bucket lifecycle rule for incomplete multipart uploads will clean it up",
                upload_id,
                self.join(key),
                _describe(exc),
                _describe(cause),
            )

    # -- get --------------------------------------------------------------------

    def get(self, key: str) -> bytes | memoryview:
        return self._download(key, expect_size=None)

    def get_verified(self, key: str, *, size: int, sha256: str, chunk_size: int = 0) -> bytes | memoryview:
        return self._download(key, expect_size=size, sha256=sha256, chunk_size=chunk_size)

    def _download(
        self, key: str, *, expect_size: int | None, sha256: str | None = None, chunk_size: int = 0
    ) -> bytes | memoryview:
        s3key = self._s3key(key)
        restarts = 3
        for attempt in range(1, restarts + 1):
            digest = BlobDigest(expect_size, chunk_size) if sha256 is not None and expect_size is not None else None
            try:
                data = self._download_once(key, s3key, expect_size, digest)
            except _ObjectChanged:
                if attempt == restarts:
                    # Never a BlobMismatch: no two answers agreed on what the object is.
                    raise StoreUnavailable(
                        f"{self.join(key)} changed (size or ETag) during each of {restarts} download attempts; "
                        "blobs are meant to be immutable: check for another writer, then retry"
                    ) from None
                log.warning("%s changed during download; restarting it", self.join(key))
                continue
            except StoreError:
                raise
            except Exception as exc:
                raise self._client_error("get", key, exc) from exc
            if digest is not None and (actual := digest.hexdigest()) != sha256:
                raise BlobMismatch(
                    f"blob {key!r} ({self.join(key)}) has sha256 {actual[:16]}… "
                    f"but its manifest records {sha256[:16]}…"
                )
            return data
        raise AssertionError("unreachable")

    def _get_range(
        self,
        key: str,
        s3key: str,
        start: int,
        end: int,
        etag: str | None,
        what: str,
        into: memoryview | Callable[[], memoryview] | None = None,
        expect_total: int | None = None,
        digest: BlobDigest | None = None,
        confirms: bool = False,
    ) -> tuple[bytes | None, dict]:
        """GET bytes ``start..end`` (inclusive); retried as a whole, truncation included.

        With ``into`` (a view of exactly ``end - start + 1`` bytes, or a function
        returning one, called only once the answer's size is checked) the body
        is read straight into it and ``None`` is returned for the data: a large
        download then costs one copy of its bytes, not a part copy plus a join.
        With ``expect_total``, an object of another size (or a range past its
        end, 416) raises :class:`BlobMismatch` if this request ``confirms`` the
        size (the first answer of a download), else ``_ObjectChanged``: a later
        answer disagreeing with an earlier one is not a consistent answer, so
        the download restarts and its first answer decides.
        A chunked ``digest`` (``start`` on a chunk boundary) is fed each chunk as
        soon as it is read, while its bytes are in this core's cache (hashing
        them there is a third faster here than from memory); a retry reads and
        hashes the whole range again.
        """

        def wrong_size(total: int | None) -> Exception:
            """``total``: the size the answer gave, None for a 416 (the object ends before ``start``)."""
            if not confirms:
                return _ObjectChanged()
            if total is None:
                return BlobMismatch(
                    f"blob {key!r} ({self.join(key)}) is shorter than the {expect_total} bytes its manifest records"
                )
            return BlobMismatch(
                f"blob {key!r} ({self.join(key)}) has {total} bytes but its manifest records {expect_total}"
            )

        def once() -> tuple[bytes | None, dict]:
            args: dict[str, Any] = {"Bucket": self.bucket, "Key": s3key, "Range": f"bytes={start}-{end}"}
            if etag is not None:
                args["IfMatch"] = etag
            try:
                resp = self.client.get_object(**args)
            except Exception as exc:
                if etag is not None and _status(exc) == 412:
                    raise _ObjectChanged() from exc
                if expect_total is not None and _status(exc) == 416:  # a range past the object's end
                    raise wrong_size(None) from exc
                raise
            body = resp["Body"]
            declared = resp.get("ContentLength")
            try:
                total = _total_size(resp, declared if declared is not None else -1)
                if expect_total is not None and total != expect_total:
                    raise wrong_size(total)
                if into is not None:
                    target = into() if callable(into) else into
                    if declared is not None and declared != len(target):
                        raise StoreUnavailable(
                            f"S3 get of {self.join(key)} returned {declared} bytes for range {start}-{end}; "
                            "the server does not honour ranged GETs correctly"
                        )
                    got = _read_into(body, target, digest, start)
                    if got != len(target):
                        raise _TruncatedBody(f"got {got} of {len(target)} bytes")
                    return None, resp
                # StreamingBody.read() checks Content-Length and raises
                # IncompleteReadError on a short body; check the range too.
                data = body.read()
            finally:
                body.close()
            if declared is not None and len(data) != declared:
                raise _TruncatedBody(f"got {len(data)} of {declared} bytes")
            return data, resp

        return self._retry(what, key, once)

    def _download_once(
        self, key: str, s3key: str, expect_size: int | None, digest: BlobDigest | None
    ) -> bytes | memoryview:
        chunk = self.download_part_size
        if expect_size is not None and expect_size > chunk:
            return self._download_known_size(key, s3key, expect_size, digest)
        try:
            first, resp = self._get_range(key, s3key, 0, chunk - 1, None, "get")
        except Exception as exc:
            if _status(exc) == 416:
                # A zero-byte object has no byte 0 to range over.
                first, resp = self._get_whole(key, s3key)
            else:
                raise
        assert first is not None
        total = _total_size(resp, len(first))
        if expect_size is not None and total != expect_size:
            raise BlobMismatch(
                f"blob {key!r} ({self.join(key)}) has {total} bytes but its manifest records {expect_size}"
            )
        if len(first) != min(total, chunk):
            raise StoreUnavailable(
                f"S3 get of {self.join(key)} returned {len(first)} bytes for the first {min(total, chunk)}; "
                "the server does not honour ranged GETs correctly"
            )
        if total <= chunk:
            if digest is not None:
                digest.update(0, first)
            return first
        # Only a plain get() (no digest) gets here: a verified one knows the size.
        # One buffer for the whole object (its size the server's own answer),
        # each ranged GET reading into its slice.
        buffer = _Buffer(total)
        buffer.slice(0, len(first))[:] = first
        del first
        ranges = ((off, min(off + chunk, total) - 1) for off in range(chunk, total, chunk))
        self._get_ranges(key, s3key, buffer, ranges, 2, resp.get("ETag"), None, None)
        return buffer.view

    def _download_known_size(self, key: str, s3key: str, size: int, digest: BlobDigest | None) -> memoryview:
        """Ranged GETs of a blob whose manifest gives its size: no request alone to learn it.

        The size is a manifest's claim, so nothing is allocated until the first
        answer's Content-Range total has matched it (the other ranges wait for
        its headers only, not its body). The answers must agree with each other
        on the ETag (else the object changed mid-download). The ranges hold
        whole chunks of a chunked digest, so each can be hashed alone.
        """
        step = digest.piece_size(self.download_part_size) if digest is not None else self.download_part_size
        buffer = _Buffer(size)
        ranges = ((off, min(off + step, size) - 1) for off in range(0, size, step))
        if len(self._get_ranges(key, s3key, buffer, ranges, 1, None, size, digest)) > 1:
            raise _ObjectChanged()
        return buffer.view

    def _get_ranges(
        self,
        key: str,
        s3key: str,
        buffer: _Buffer,
        ranges: Iterator[tuple[int, int]],
        first_number: int,
        etag: str | None,
        expect_total: int | None,
        digest: BlobDigest | None,
    ) -> set[str | None]:
        """GET ``ranges`` in parallel into their slices of ``buffer``, feeding ``digest``
        (a chunked one as each worker reads, a plain one here in order as the
        ranges complete, later ones downloading meanwhile). Returns the ETags the
        answers carried.

        The first range goes alone until its answer has confirmed the size and
        the buffer exists; then at most ``2 * max_concurrency`` ranges are in
        flight (queued or running): enough to keep every worker busy while the
        oldest completes, and a bounded cost however many ranges there are.
        """
        in_worker = digest is not None and digest.any_order
        pool = self._executor()
        numbered = enumerate(ranges, start=first_number)
        pending: collections.deque[tuple[int, int, concurrent.futures.Future]] = collections.deque()

        def submit() -> bool:
            item = next(numbered, None)
            if item is None:
                return False
            n, (a, b) = item
            fut = pool.submit(
                self._get_range, key, s3key, a, b, etag, "get" if n == 1 else f"get part {n}",
                functools.partial(buffer.slice, a, b + 1), expect_total, digest if in_worker else None,
                n == first_number,
            )
            pending.append((a, b, fut))
            return True

        etags = set()
        try:
            submit()
            buffer.wait_allocated(pending[0][2])
            while len(pending) < 2 * self.max_concurrency and submit():
                pass
            while pending:
                a, b, fut = pending[0]
                _, resp = fut.result()
                pending.popleft()
                etags.add(resp.get("ETag"))
                if digest is not None and not in_worker:
                    digest.update(a, buffer.view[a : b + 1])
                submit()
        except BaseException:
            for *_, f in pending:
                f.cancel()
            concurrent.futures.wait([f for *_, f in pending])
            raise
        return etags

    def _get_whole(self, key: str, s3key: str) -> tuple[bytes, dict]:
        def once() -> tuple[bytes, dict]:
            resp = self.client.get_object(Bucket=self.bucket, Key=s3key)
            body = resp["Body"]
            try:
                data = body.read()
            finally:
                body.close()
            return data, resp

        return self._retry("get", key, once)

    # -- list / delete ----------------------------------------------------------

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        token: str | None = None
        full_prefix = self.prefix + prefix
        try:
            while True:
                args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
                if token:
                    args["ContinuationToken"] = token
                page = self._retry("list", f"{prefix}*", lambda: self.client.list_objects_v2(**args))
                for obj in page.get("Contents", []):
                    out.append(
                        ObjectInfo(obj["Key"][len(self.prefix) :], int(obj["Size"]), obj["LastModified"].timestamp())
                    )
                if not page.get("IsTruncated"):
                    break
                token = page.get("NextContinuationToken")
        except StoreError:
            raise
        except Exception as exc:
            raise self._client_error("list", f"{prefix}*", exc) from exc
        # S3 already lists in UTF-8 byte order; sort anyway so every backend agrees.
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        s3key = self._s3key(key)
        try:
            self._retry("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=s3key))
        except StoreError:
            raise
        except Exception as exc:
            if _status(exc) == 404:
                return  # some S3-compatible servers answer 404 where S3 answers 204
            raise self._client_error("delete", key, exc) from exc


_READ_SIZE = 256 * 1024


def default_concurrency() -> int:
    """Transfers in flight per store: 3 per usable CPU, at most boto3's 10.

    Past that, on a small machine, more connections add contention, not
    speed: each transfer costs CPU (SigV4 hashes upload payloads; downloads
    copy, fault in fresh pages and hash every chunk). On 2 cores with the S3
    server alongside (bench/checkpoint.py), 6 in flight loaded 1 GB in 1.9 s
    where 10 took 2.1 s, and uploaded it in 7.5 s where 10 took 7.9 s.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(10, 3 * cpus))


def _read_into(body: Any, into: memoryview, digest: BlobDigest | None = None, offset: int = 0) -> int:
    """Read a GET body into ``into``; returns the byte count (short if truncated).

    A plain (not content-encoded) urllib3 response is read through its
    ``http.client`` response, straight from the socket into ``into``: one copy.
    urllib3 1.26's own ``readinto`` reads into a temporary of the size asked
    and copies twice more. Anything else goes through botocore's body, in
    pieces as s3transfer reads (part-sized temporaries cost fresh pages).
    Each whole chunk of ``digest`` (``into`` holding the blob from ``offset``)
    is hashed as soon as it is in.
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    direct = isinstance(fp, http.client.HTTPResponse) and not raw.headers.get("content-encoding")
    read = fp.readinto if direct else body.readinto
    chunk = digest.chunk_size if digest is not None else len(into)
    got = hashed = 0
    while got < len(into):
        end = min(hashed + chunk, len(into))
        n = read(into[got : end if direct else min(end, got + _READ_SIZE)])
        if not n:
            break
        got += n
        if digest is not None and got == end:
            digest.update(offset + hashed, into[hashed:got])
            hashed = got
    if direct and fp.isclosed():
        raw.release_conn()  # urllib3 does this when it reads the end itself
    return got


class _Buffer:
    """A download's buffer, allocated by the first request that needs it.

    When ``size`` is a manifest's claim, the first range's worker asks for its
    slice only after the answer's Content-Range total has matched that size:
    a corrupt manifest (10**15 bytes) costs a BlobMismatch, not an allocation.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._view: memoryview | None = None
        self._lock = threading.Lock()
        self._allocated = threading.Event()

    @property
    def view(self) -> memoryview:
        assert self._view is not None, "the buffer is allocated by the first slice taken"
        return self._view

    def slice(self, start: int, stop: int) -> memoryview:
        with self._lock:
            if self._view is None:
                self._view = _buffer(self.size)
                self._allocated.set()
        return self._view[start:stop]

    def wait_allocated(self, first: concurrent.futures.Future) -> None:
        """Wait until the buffer exists, or ``first`` (the request that allocates it) failed: raise its error."""
        first.add_done_callback(lambda _f: self._allocated.set())
        self._allocated.wait()
        if self._view is None:
            first.result()  # raises what stopped it
            raise AssertionError("the first range completed without allocating the buffer")


def _buffer(size: int) -> memoryview:
    """A writable buffer for a download, not zero-filled up front.

    An anonymous mapping: the kernel supplies each page as a ranged GET first
    writes it, where ``bytearray(size)`` first zeroes the whole buffer in one
    thread (0.5 s per GB here, before the first byte arrives). Private, not
    Python's default shared mapping: shared anonymous memory is shmem, whose
    page faults cost twice as much CPU (perf: a 1 GB load spent half its time
    in shmem_get_folio_gfp).
    """
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def _total_size(resp: dict, got: int) -> int:
    """The whole object's size from a (possibly ranged) GET response."""
    match = _CONTENT_RANGE.match(str(resp.get("ContentRange") or ""))
    if match and match.group(3) != "*":
        return int(match.group(3))
    return got  # a 200 answer to a ranged GET: the server sent the whole object


def _make_client(
    *,
    endpoint_url: str | None,
    profile: str | None,
    region: str | None,
    connect_timeout: float,
    read_timeout: float,
    pool_size: int,
) -> Any:
    """A boto3 S3 client from the standard configuration, with botocore's retries off.

    ``endpoint_url=None`` lets boto3 apply ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` and the profile's ``endpoint_url`` itself.
    """
    import boto3
    import botocore.session
    from botocore.config import Config

    config = Config(
        # One attempt: our tenacity policy does the retrying, and logs it.
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=pool_size,
    )
    # A fresh session per store, so environment and profile changes apply, but
    # one shared loader of botocore's service models: parsing the S3 model
    # again for every store doubles the cost of opening one.
    core = botocore.session.Session()
    core.register_component("data_loader", _shared_loader())
    session = boto3.session.Session(botocore_session=core, profile_name=profile)
    return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    global _loader
    import botocore.loaders

    with _loader_lock:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        return _loader


__all__ = ["ENV_SSE", "ENV_SSE_KMS_KEY_ID", "S3Store", "is_transient", "parse_s3_uri"]
