"""Puts: one ``PutObject``, or a parallel multipart upload at ``multipart_threshold`` bytes and above.

Conditional create: ``if_absent=True`` sends ``If-None-Match: *`` (on
``PutObject``, or on ``CompleteMultipartUpload``); a 412 becomes
:class:`ObjectExists`. A retried conditional put whose first attempt was
committed but whose response was lost also answers 412: nothing here can
tell that apart, so it is :class:`ObjectExists` too, and the manifest writer
re-reads the object and compares its writer token. A multipart upload whose
part finally fails is aborted, so no invisible parts are left to bill.
Server-side encryption arguments go on the ``PutObject`` or the create.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

from elastic_ft.checkpoint.errors import ObjectExists, StoreError
from elastic_ft.checkpoint.s3.errors import code, describe, status
from elastic_ft.checkpoint.s3.target import S3Target
from elastic_ft.checkpoint.segments import Data, Segments, as_segments

log = logging.getLogger(__name__)

# S3 allows at most this many parts in one upload.
_MAX_PARTS = 10_000


def put(t: S3Target, key: str, data: Data, *, if_absent: bool = False) -> None:
    """Write ``data`` at ``key`` (see the module docstring); raises a store error naming the object."""
    s3key = t.s3key(key)
    segments = as_segments(data)
    try:
        if len(segments) >= t.options.multipart_threshold:
            _put_multipart(t, key, s3key, segments, if_absent)
        else:
            _put_single(t, key, s3key, segments.tobytes(), if_absent)
    except StoreError:
        raise
    except Exception as exc:
        if if_absent and status(exc) == 412:
            raise ObjectExists(
                f"{t.join(key)} already exists (if this put was retried after a lost answer, "
                "it may be this writer's own object: read it back and compare before giving up)"
            ) from exc
        raise t.error("put", key, exc) from exc


def _put_single(t: S3Target, key: str, s3key: str, body: bytes, if_absent: bool) -> None:
    args: dict[str, Any] = {"Bucket": t.bucket, "Key": s3key, "Body": body, **t.options.sse_args}
    if if_absent:
        args["IfNoneMatch"] = "*"
    t.retry("put", key, lambda: t.client.put_object(**args))


def _put_multipart(t: S3Target, key: str, s3key: str, segments: Segments, if_absent: bool) -> None:
    # Mirror boto3's own upload_file (s3transfer): when the client computes
    # checksums by default, declare CRC32 for the upload and hand every
    # part's checksum back on completion, so S3 verifies each part's bytes.
    checksum = getattr(t.client.meta.config, "request_checksum_calculation", None) == "when_supported"
    extra = {"ChecksumAlgorithm": "CRC32"} if checksum else {}
    created = t.retry(
        "multipart create",
        key,
        lambda: t.client.create_multipart_upload(Bucket=t.bucket, Key=s3key, **t.options.sse_args, **extra),
    )
    upload_id = created["UploadId"]
    try:
        parts = _upload_parts(t, key, s3key, upload_id, segments, extra)
        _complete(t, key, s3key, upload_id, parts, if_absent)
    except BaseException as exc:
        _abort(t, key, s3key, upload_id, exc)
        raise


def _upload_parts(
    t: S3Target, key: str, s3key: str, upload_id: str, segments: Segments, extra: dict[str, str]
) -> list[dict[str, Any]]:
    """Upload every part in parallel; the completion list, in part order. The first failure cancels the rest."""
    # Grow the part size for huge objects, to stay within S3's part count.
    part_size = max(t.options.part_size, -(-len(segments) // _MAX_PARTS))

    def upload(number: int, offset: int) -> dict[str, Any]:
        # Gathered in the worker: at most max_concurrency parts in memory at once.
        body = segments.read(offset, part_size)
        out = t.retry(
            f"upload part {number}",
            key,
            lambda: t.client.upload_part(
                Bucket=t.bucket, Key=s3key, UploadId=upload_id, PartNumber=number, Body=body, **extra
            ),
        )
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if extra and "ChecksumCRC32" in out:
            part["ChecksumCRC32"] = out["ChecksumCRC32"]
        return part

    pool = t.executor()
    offsets = range(0, len(segments), part_size)
    futures = [pool.submit(upload, n, off) for n, off in enumerate(offsets, start=1)]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)
        raise


def _complete(t: S3Target, key: str, s3key: str, upload_id: str, parts: list[dict[str, Any]], if_absent: bool) -> None:
    complete: dict[str, Any] = {
        "Bucket": t.bucket,
        "Key": s3key,
        "UploadId": upload_id,
        "MultipartUpload": {"Parts": parts},
    }
    if if_absent:
        complete["IfNoneMatch"] = "*"

    def finish() -> Any:
        try:
            return t.client.complete_multipart_upload(**complete)
        except Exception as exc:
            # A retried complete whose first attempt succeeded finds the upload
            # gone; if the object is there with our part count the upload did commit.
            if code(exc) == "NoSuchUpload" and _committed_multipart(t, s3key, len(parts)):
                return None
            raise

    t.retry("multipart complete", key, finish)


def _committed_multipart(t: S3Target, s3key: str, part_count: int) -> bool:
    try:
        head = t.client.head_object(Bucket=t.bucket, Key=s3key)
    except Exception:
        return False
    return str(head.get("ETag", "")).strip('"').endswith(f"-{part_count}")


def _abort(t: S3Target, key: str, s3key: str, upload_id: str, cause: BaseException) -> None:
    """Abort a failed multipart upload so its parts do not linger (and cost)."""
    try:
        t.retry(
            "multipart abort",
            key,
            lambda: t.client.abort_multipart_upload(Bucket=t.bucket, Key=s3key, UploadId=upload_id),
        )
    except Exception as exc:
        if code(exc) == "NoSuchUpload":
            return  # already completed or aborted
        log.warning(
            "could not abort the failed multipart upload %s of %s (%s) after: %s; "
            "a bucket lifecycle rule for incomplete multipart uploads will clean it up",
            upload_id,
            t.join(key),
            describe(exc),
            describe(cause),
        )


__all__ = ["put"]
