"""The S3 side of fetching inputs: HEAD, LIST (every page, bounded) and a GET streamed to a file.

The client is the checkpoint store's (:func:`~elastic_ft.checkpoint.s3.client.make_client`
from the spec's ``checkpoint.s3`` settings and boto3's chain), and every
request runs under the store's retry policy (bounded backoff, each retry
logged, a final :class:`StoreUnavailable` stating the count); a final failure
is the store's domain error (:func:`~elastic_ft.checkpoint.s3.errors.client_error`):
:class:`ObjectNotFound` for a 404, :class:`StoreUnavailable` otherwise.

A GET is pinned to the ETag the plan saw (``If-Match``, and the answer's ETag
compared too, for servers that ignore the header): an object overwritten in
between raises ``ObjectChanged`` rather than caching a mix of two versions.
A body shorter than the object is retried as a whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.s3.client import make_client
from elastic_ft.checkpoint.s3.errors import ObjectChanged, TruncatedBody, client_error, status
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.checkpoint.s3.retry import with_retries
from elastic_ft.inputs.plan import RemoteObject
from elastic_ft.inputs.uri import InputRefused, S3Location, key_problem

T = TypeVar("T")
_CHUNK = 1 << 20


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

    def download(self, bucket: str, obj: RemoteObject, dest: str) -> str:
        """Write ``obj`` to ``dest`` (truncated first, fsynced), pinned to its ETag; its sha256."""
        uri = f"s3://{bucket}/{obj.key}"
        return self._call("get", uri, bucket, lambda: self._download_once(bucket, obj, dest))

    def _download_once(self, bucket: str, obj: RemoteObject, dest: str) -> str:
        try:
            resp = self.client.get_object(Bucket=bucket, Key=obj.key, IfMatch=f'"{obj.etag}"')
        except Exception as exc:
            if status(exc) == 412:
                raise ObjectChanged(obj.key) from exc
            raise
        if _etag(resp.get("ETag")) != obj.etag:
            raise ObjectChanged(obj.key)
        digest, written = hashlib.sha256(), 0
        with open(dest, "wb") as f:
            for chunk in resp["Body"].iter_chunks(_CHUNK):
                written += len(chunk)
                if written > obj.size:
                    raise ObjectChanged(obj.key)  # more bytes than the object had: another version
                f.write(chunk)
                digest.update(chunk)
            if written != obj.size:
                raise TruncatedBody(f"{written} of {obj.size} bytes")
            f.flush()
            os.fsync(f.fileno())
        return digest.hexdigest()

    def close(self) -> None:
        if self._owns_client and hasattr(self.client, "close"):
            self.client.close()


__all__ = ["RemoteInputs"]
