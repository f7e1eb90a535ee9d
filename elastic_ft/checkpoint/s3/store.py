""":class:`S3Store`: the ``s3://bucket/prefix`` object store, composed of this package's parts.

The store itself only wires them together: settings (:mod:`.options`), the
client (:mod:`.client`), the bucket, prefix and retry policy every request
shares (:mod:`.target`), and the verbs: :mod:`.upload`, :mod:`.download`,
:mod:`.listing`. See the package docstring for the behaviour.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from elastic_ft.checkpoint.s3 import download, listing, upload
from elastic_ft.checkpoint.s3.client import make_client
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.checkpoint.s3.target import S3Target
from elastic_ft.checkpoint.s3.uri import parse_s3_uri
from elastic_ft.checkpoint.segments import Data
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix/``; see :mod:`elastic_ft.checkpoint.s3` for behaviour.

    Args:
        bucket: the bucket name.
        prefix: the key prefix of this store's root ('' or ending in '/'; one is added).
        client: a boto3 S3 client to use (its owner closes it); by default one
            is built from ``options`` with botocore's retries off.
        profile: the named AWS profile the built client's credentials come
            from (default: boto3's, i.e. ``AWS_PROFILE``); never a setting.
        uri: the URI for messages (default ``s3://bucket/prefix``).
        options: the settings (:class:`S3Options`); unset fields fall back to
            the environment, then the defaults.
        **settings: :class:`S3Options` fields, overriding ``options``'s.

    Raises :class:`StoreError` naming every invalid setting.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        profile: str | None = None,
        uri: str | None = None,
        options: S3Options | None = None,
        **settings: Any,
    ) -> None:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        uri = uri or f"s3://{bucket}/{prefix}".rstrip("/")
        given = {**(dataclasses.asdict(options) if options is not None else {}), **settings}
        resolved = S3Options.resolve(given)
        resolved.check(f"S3 store for {uri}")
        self._owns_client = client is None
        self._target = S3Target(
            client=make_client(resolved, profile) if client is None else client,
            bucket=bucket, prefix=prefix, uri=uri, options=resolved,
        )
        self.bucket, self.prefix, self.uri, self.options = bucket, prefix, uri, resolved

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> S3Store:
        """Open ``s3://bucket/prefix``; keyword arguments as for the constructor."""
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket, prefix, uri=uri.rstrip("/"), **kwargs)

    @property
    def client(self) -> Any:
        """The boto3 client every request goes through."""
        return self._target.client

    @property
    def max_concurrency(self) -> int:
        """Parts uploaded / ranged GETs in flight at most."""
        return self._target.max_concurrency

    @property
    def sse_args(self) -> dict[str, str]:
        """The server-side encryption arguments every put sends (empty for none)."""
        return self.options.sse_args

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._target.executor()

    def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        upload.put(self._target, key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes | memoryview:
        return download.download(self._target, key)

    def get_verified(self, key: str, *, size: int, sha256: str, chunk_size: int = 0) -> bytes | memoryview:
        return download.download(self._target, key, expect_size=size, sha256=sha256, chunk_size=chunk_size)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return listing.list_objects(self._target, prefix)

    def delete(self, key: str) -> None:
        listing.delete_object(self._target, key)

    def close(self) -> None:
        self._target.close_pool()
        if self._owns_client and hasattr(self.client, "close"):
            self.client.close()  # its connection pool; a client passed in is its owner's to close


__all__ = ["S3Store"]
