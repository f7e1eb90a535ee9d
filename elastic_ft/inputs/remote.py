"""The S3 side of fetching inputs: HEAD, LIST (every page, bounded) and GETs written to a file.

The client is the checkpoint store's (:func:`~elastic_ft.checkpoint.s3.client.make_client`
from the spec's ``checkpoint.s3`` settings and boto3's chain), and every
request runs under the store's retry policy (bounded backoff, each retry
logged, a final :class:`StoreUnavailable` stating the count); a final failure
is the store's domain error (:func:`~elastic_ft.checkpoint.s3.errors.client_error`):
:class:`ObjectNotFound` for a 404, :class:`StoreUnavailable` otherwise.

A download is the checkpoint store's read path into a file
(:func:`~elastic_ft.checkpoint.s3.download.download_to_file`): one GET for an
object of one ``checkpoint.s3.download_part_size`` or less, else parallel
ranged GETs (at most ``checkpoint.s3.max_concurrency`` at once), each range
written at its offset as it lands and retried alone when it fails or comes
back short. Memory: one range per worker, whatever the object's size; a 16 GB
model costs its download time, not 16 GB of memory. Every GET is pinned to the
ETag the plan saw (``If-Match``, and every answer's ETag compared too, for
servers that ignore the header): an object overwritten in between raises
``ObjectChanged`` rather than caching a mix of two versions. The file is
hashed while it lands (the chunked sha256 of
:mod:`elastic_ft.checkpoint.digest`, each 1 MiB chunk by the worker that read
it), so the cache records its digest without reading it again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

from elastic_ft.checkpoint.digest import CHUNK_SIZE, BlobDigest
from elastic_ft.checkpoint.errors import BlobMismatch, StoreError
from elastic_ft.checkpoint.s3.client import make_client
from elastic_ft.checkpoint.s3.download import download_to_file
from elastic_ft.checkpoint.s3.errors import ObjectChanged, client_error, status
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.checkpoint.s3.retry import with_retries
from elastic_ft.checkpoint.s3.target import S3Target
from elastic_ft.inputs.plan import RemoteObject
from elastic_ft.inputs.uri import InputRefused, S3Location, key_problem

T = TypeVar("T")

DIGEST_CHUNK = CHUNK_SIZE
"""Chunk of the digest recorded for each downloaded file (the checkpoint blobs' own: 1 MiB)."""


def _etag(value: Any) -> str:
    return str(value or "").strip('"')


class RemoteInputs:
    """Objects of any bucket through one client built from ``options`` (or ``client``, its owner's to close)."""

    def __init__(self, options: S3Options, client: Any = None, *, page_size: int = 1000) -> None:
        resolved = S3Options.resolve({k: v for k, v in dataclasses.asdict(options).items() if v is not None})
        resolved.check("checkpoint.s3 (the S3 settings the inputs use too)")
        self.options = resolved
        self.page_size = page_size  # keys per LIST page (S3 answers at most 1000)
        self._owns_client = client is None
        self.client = make_client(resolved) if client is None else client
        self._targets: dict[str, S3Target] = {}  # per bucket: its worker pool of ranged GETs

    def _call(self, what: str, uri: str, bucket: str, fn: Callable[[], T]) -> T:
        o = self.options
        try:
            return with_retries(fn, what=what, uri=uri, max_attempts=o.max_attempts,
                                backoff_initial=o.backoff_initial, backoff_max=o.backoff_max)
        except (StoreError, ObjectChanged):
            raise
        except Exception as exc:
            raise client_error(what, uri, bucket, exc) from exc

    def head(self, loc: S3Location, rel: str) -> RemoteObject:
        """The object at ``loc`` as it is now, to be cached as ``rel``."""
        resp = self._call("head", loc.uri, loc.bucket,
                          lambda: self.client.head_object(Bucket=loc.bucket, Key=loc.key))
        return RemoteObject(loc.key, rel, _etag(resp.get("ETag")), int(resp["ContentLength"]))

    def list(self, loc: S3Location, max_files: int) -> list[RemoteObject]:
        """Every object under the prefix ``loc`` (all pages), each with its path relative to the prefix.

        Zero-byte keys ending in '/' (folder markers of consoles) are skipped. Raises
        :class:`InputRefused` past ``max_files`` objects, or for a key that cannot be a cache path.
        """
        out: list[RemoteObject] = []
        args: dict[str, Any] = {"Bucket": loc.bucket, "Prefix": loc.key, "MaxKeys": self.page_size}
        while True:
            page = self._call("list", f"{loc.uri}*", loc.bucket, lambda: self.client.list_objects_v2(**args))
            for obj in page.get("Contents", []):
                key, size = obj["Key"], int(obj["Size"])
                if key.endswith("/") and size == 0:
                    continue
                rel = key[len(loc.key):]
                problem = key_problem(rel)
                if problem:
                    raise InputRefused(f"{loc.uri} holds {key!r}, which cannot be cached: {problem}")
                out.append(RemoteObject(key, rel, _etag(obj.get("ETag")), size))
                if len(out) > max_files:
                    raise InputRefused(f"{loc.uri} holds more than inputs.max_model_files ({max_files}) objects; "
                                        "raise it, or point at the model's own prefix")
            if not page.get("IsTruncated"):
                return out
            args["ContinuationToken"] = page.get("NextContinuationToken")

    def _target(self, bucket: str) -> S3Target:
        if bucket not in self._targets:
            self._targets[bucket] = S3Target(client=self.client, bucket=bucket, prefix="", uri=f"s3://{bucket}",
                                             options=self.options)
        return self._targets[bucket]

    def download(self, bucket: str, obj: RemoteObject, dest: str) -> str:
        """Write ``obj`` to ``dest`` (created or truncated, fsynced), pinned to its ETag; its digest
        (:func:`~elastic_ft.checkpoint.digest.blob_sha256` with chunks of :data:`DIGEST_CHUNK`).

        Raises ``ObjectChanged`` when the object is no longer the one planned
        (another ETag, or another size), else the store's domain errors.
        """
        uri = f"s3://{bucket}/{obj.key}"
        digest = BlobDigest(obj.size, DIGEST_CHUNK)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            try:
                if obj.size == 0:
                    etags = {self._call("get", uri, bucket, lambda: self._get_empty(bucket, obj))}
                else:
                    etags = download_to_file(self._target(bucket), obj.key, obj.key, fd, size=obj.size,
                                             etag=f'"{obj.etag}"', digest=digest)
            except BlobMismatch as exc:  # the first answer's size is not the plan's: another version
                raise ObjectChanged(obj.key) from exc
            except (StoreError, ObjectChanged):
                raise
            except Exception as exc:
                raise client_error("get", uri, bucket, exc) from exc
            if {_etag(e) for e in etags} != {obj.etag}:
                raise ObjectChanged(obj.key)  # a server that ignored If-Match answered another version
            os.fsync(fd)
        finally:
            os.close(fd)
        return digest.hexdigest()

    def _get_empty(self, bucket: str, obj: RemoteObject) -> str | None:
        """GET a zero-byte object (no byte range to ask for), pinned to its ETag; the answer's ETag."""
        try:
            resp = self.client.get_object(Bucket=bucket, Key=obj.key, IfMatch=f'"{obj.etag}"')
        except Exception as exc:
            if status(exc) == 412:
                raise ObjectChanged(obj.key) from exc
            raise
        body = resp["Body"]
        try:
            if body.read(1):
                raise ObjectChanged(obj.key)  # bytes where the plan saw none: another version
        finally:
            body.close()
        return resp.get("ETag")

    def close(self) -> None:
        for target in self._targets.values():
            target.close_pool()
        self._targets.clear()
        if self._owns_client and hasattr(self.client, "close"):
            self.client.close()


__all__ = ["RemoteInputs"]
