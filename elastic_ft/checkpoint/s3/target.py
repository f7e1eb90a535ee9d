"""One prefix of one bucket through one client: what every request of a store needs.

Upload, download and listing are functions of an :class:`S3Target`: it maps
store keys to S3 keys and URIs, runs a request under the retry policy, maps a
final failure to a store error, and owns the worker pool that parallel parts
and ranges share (created on first use, at most ``max_concurrency`` threads).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.s3.errors import client_error
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.checkpoint.s3.retry import with_retries
from elastic_ft.checkpoint.store import check_key

T = TypeVar("T")


class S3Target:
    """``s3://bucket/prefix`` through ``client``, with resolved and checked ``options``."""

    def __init__(self, *, client: Any, bucket: str, prefix: str, uri: str, options: S3Options) -> None:
        assert options.max_concurrency is not None, "resolve the options first"
        self.client, self.bucket, self.prefix, self.uri, self.options = client, bucket, prefix, uri, options
        self.max_concurrency: int = options.max_concurrency
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def s3key(self, key: str) -> str:
        """The S3 key of store key ``key``; :class:`StoreError` for a malformed one."""
        check_key(key)
        return self.prefix + key

    def join(self, key: str) -> str:
        """The full URI of ``key``, for messages."""
        return f"{self.uri.rstrip('/')}/{key}"

    def retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request on ``key`` under the retry policy (see :mod:`~elastic_ft.checkpoint.s3.retry`)."""
        o = self.options
        return with_retries(fn, what=what, uri=self.join(key), max_attempts=o.max_attempts,
                            backoff_initial=o.backoff_initial, backoff_max=o.backoff_max)

    def error(self, what: str, key: str, exc: BaseException) -> StoreError:
        """The store error for a final failure of ``what`` on ``key``."""
        return client_error(what, self.join(key), self.bucket, exc)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The worker pool of parts and ranges (created on first use)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix="s3store"
                )
            return self._pool

    def close_pool(self) -> None:
        """Wait for and release the worker pool; a later transfer creates a new one."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["S3Target"]
