"""The object store's errors, apart from any backend so that every backend and
every caller can import them without importing each other.

The classes say what a caller may conclude: :class:`ObjectNotFound` and
:class:`BlobMismatch` are answers the store gave; :class:`StoreUnavailable`
means it could not answer, and nothing may be decided from it.
"""

from __future__ import annotations


class StoreError(Exception):
    """A storage operation failed; the message names the object and what to do."""


class ObjectNotFound(StoreError):
    """The key does not exist in the store."""


class StoreUnavailable(StoreError):
    """The store could not answer: retries ran out, access was denied, the disk or
    the network failed. Nothing is known about the object, so nothing may be
    decided from it (no checkpoint is retired, no blob deleted): stop and retry later."""


class ObjectExists(StoreError):
    """A put with ``if_absent=True`` found the key already there (HTTP 412 on S3)."""


class UnsupportedURI(StoreError, ValueError):
    """The checkpoint URI's scheme has no backend, or the URI is malformed for its scheme."""


class BlobMismatch(StoreError):
    """A blob's bytes do not match the size or sha256 its manifest recorded."""


__all__ = ["BlobMismatch", "ObjectExists", "ObjectNotFound", "StoreError", "StoreUnavailable", "UnsupportedURI"]
