"""The object store: the narrow interface every checkpoint backend implements.

A checkpoint is a set of immutable blobs plus one manifest written last. The
store only needs five verbs for that; everything about *what* is stored (the
manifest, hashing, retention) lives above it, so the filesystem and S3 backends
stay small and are tested by one contract suite.

Keys are '/'-separated strings relative to the store's root (the run's URI).
They stay ``str`` rather than ``Path`` because ``Path`` folds the double slash
of ``s3://`` and would change a key's meaning between backends.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import os
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.errors import (
    BlobMismatch,
    ObjectExists,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
    UnsupportedURI,
)
from elastic_ft.checkpoint.segments import Data


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (relative to the store root), size in bytes and
    last-modified time (seconds since the epoch, the store's clock)."""

    key: str
    size: int
    mtime: float


class ObjectStore(abc.ABC):
    """Immutable-blob storage rooted at one URI (a run's checkpoint location).

    Edge cases every implementation honours (the contract suite checks them):
    - ``put`` is atomic: a reader sees the whole object or nothing, never a prefix.
    - ``put(..., if_absent=True)`` creates the key only if no object is there and
      raises :class:`ObjectExists` otherwise; of two racing writers exactly one wins.
    - ``get`` of a missing key raises :class:`ObjectNotFound`.
    - ``list`` returns objects whose key starts with ``prefix`` (a plain string
      prefix, not a directory), sorted by key; an empty list if none.
    - ``delete`` of a missing key is not an error (deletes are retried).
    - ``get_verified`` checks the declared size against the object's real size
      before allocating anything of that size, and raises :class:`BlobMismatch`
      only for an answer the store gave consistently (a wrong size or digest).
    Transient faults are retried inside the implementation; what escapes is a
    :class:`StoreError` whose message names the key. Whenever the store could
    not answer (retries ran out, access denied, credentials expired, a disk
    error, an error nobody classified) it is :class:`StoreUnavailable`, so that
    callers never take "could not read" for "corrupt" or "missing".
    """

    #: The URI this store is rooted at, as given by the user (for messages).
    uri: str

    @abc.abstractmethod
    def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        """Write ``data`` at ``key`` atomically."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | memoryview:
        """Return the whole object at ``key``.

        Large objects may come back as a writable ``memoryview`` of a buffer the
        download filled in place (S3), so that the loader can view tensors in it
        without a second copy.
        """

    def get_verified(self, key: str, *, size: int, sha256: str, chunk_size: int = 0) -> bytes | memoryview:
        """Return the object at ``key`` after checking its size and digest.

        ``sha256`` is the digest over chunks of ``chunk_size`` bytes that the
        manifest records (:mod:`elastic_ft.checkpoint.digest`; 0: a plain
        sha256). Backends that stream may override this to hash while
        downloading; the default hashes after :meth:`get`. Raises :class:`BlobMismatch`.
        """
        data = self.get(key)
        check_blob(key, data, size=size, sha256=sha256, chunk_size=chunk_size)
        return data

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """List objects under ``prefix``, sorted by key."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is fine."""

    def close(self) -> None:
        """Release clients and pools; the default holds none."""

    def join(self, key: str) -> str:
        """The full URI of ``key``, for messages and ``ckpt`` output."""
        return f"{self.uri.rstrip('/')}/{key}"


def check_blob(key: str, data: bytes | memoryview, *, size: int, sha256: str, chunk_size: int = 0) -> None:
    """Raise :class:`BlobMismatch` naming ``key`` unless ``data`` has ``size`` and digest ``sha256``
    (chunked by ``chunk_size``: :mod:`elastic_ft.checkpoint.digest`)."""
    if len(data) != size:
        raise BlobMismatch(f"blob {key!r} has {len(data)} bytes but its manifest records {size}")
    actual = blob_sha256(data, chunk_size, threads=os.cpu_count() or 1)
    if actual != sha256:
        raise BlobMismatch(f"blob {key!r} has sha256 {actual[:16]}… but its manifest records {sha256[:16]}…")


def check_key(key: str) -> None:
    """Raise :class:`StoreError` unless ``key`` is '/'-separated names without '', '.' or '..'
    (an empty segment or a '..' would name another object, or escape the root, on some backend)."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"invalid object key {key!r}: keys are '/'-separated names without '.' or '..'")


# -- the scheme registry --------------------------------------------------------
#
# Backends are named by dotted path and imported only when a URI of their scheme
# is checked or opened, so importing this module never imports boto3, and no
# backend module is imported by this one (each imports only this module and
# :mod:`elastic_ft.checkpoint.errors`): a new scheme is one module plus one
# ``register_scheme`` line.


@dataclasses.dataclass(frozen=True)
class _Scheme:
    opener: str  # "module:attr[.attr]": called with the URI, returns an ObjectStore
    checker: str | None  # "module:attr[.attr]": called with the URI, raises for a malformed one


_SCHEMES: dict[str, _Scheme] = {}


def register_scheme(scheme: str, opener: str, *, checker: str | None = None) -> None:
    """Open ``scheme://`` URIs with the callable at dotted path ``opener`` ("package.module:name").

    ``checker`` (same form) validates a URI without opening anything; it may raise
    any :class:`StoreError`. Both are imported on first use. Registering a scheme
    again replaces it (a test or plugin may override a backend). Raises
    :class:`ValueError` for a scheme that is not a URI scheme or a path without ':'.
    """
    key = scheme.lower()
    if not key or not key[0].isalpha() or not all(c.isalnum() or c in "+-." for c in key):
        raise ValueError(f"register_scheme: {scheme!r} is not a URI scheme (a letter, then letters, digits, '+-.')")
    for what, path in (("opener", opener), ("checker", checker)):
        if path is not None and ":" not in path:
            raise ValueError(f"register_scheme: {what} {path!r} must be 'package.module:callable'")
    _SCHEMES[key] = _Scheme(opener, checker)


def registered_schemes() -> list[str]:
    """The schemes :func:`open_store` accepts, sorted (a plain path means ``file``)."""
    return sorted(_SCHEMES)


def _resolve(path: str) -> Callable[[str], Any]:
    """Import ``package.module:attr[.attr]`` and return the attribute."""
    module_name, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


def _scheme_of(uri: str) -> tuple[str, _Scheme]:
    """The URI's scheme (a plain path is ``file``) and its registration; :class:`UnsupportedURI` if none."""
    scheme = urllib.parse.urlparse(uri).scheme
    entry = _SCHEMES.get(scheme.lower() or "file")
    if entry is None:
        known = ", ".join(f"{s}://" for s in registered_schemes())
        raise UnsupportedURI(f"checkpoint URI {uri!r} has unsupported scheme {scheme!r}; known schemes: {known}")
    return scheme.lower() or "file", entry


def check_uri(uri: str) -> str | None:
    """The local path of a file URI (or plain path), None for other schemes; raises for a URI :func:`open_store` refuses.

    Opens nothing, so a command can check the URI as the user typed it before
    any work, and the message quotes exactly that: joining a run id onto a bad
    base first would garble it ('s3://' + 'run' reads 's3:/run'). A file URI
    without a path ('file://', '') is refused: joined with a run id it would
    silently mean '/run', at the filesystem root. Other schemes are checked by
    their registered ``checker``, if any. An unknown scheme raises
    :class:`UnsupportedURI` naming it and the known ones.
    """
    scheme, entry = _scheme_of(uri)
    if scheme == "file":
        return _file_path(uri)
    if entry.checker is not None:
        _resolve(entry.checker)(uri)
    return None


def _file_path(uri: str) -> str:
    """The path of ``file:///abs``, ``file://./rel`` or a plain path; :class:`UnsupportedURI` for others."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme and parsed.netloc not in ("", "localhost", "."):
        raise UnsupportedURI(
            f"checkpoint URI {uri!r}: file URIs must be file:///absolute/path or file://./relative/path"
        )
    path = (parsed.netloc + parsed.path) if parsed.netloc == "." else (parsed.path if parsed.scheme else uri)
    if not path:
        raise UnsupportedURI(f"checkpoint URI {uri!r} has no path; write file:///absolute/path or file://./relative/path")
    return path


def open_store(uri: str, settings: Mapping[str, Mapping[str, Any]] | None = None) -> ObjectStore:
    """Open the store for a run's URI: ``file:///abs/dir``, a plain path, ``s3://bucket/prefix``,
    or any scheme added with :func:`register_scheme`.

    The URI is checked first (:func:`check_uri`), so every scheme refuses a
    malformed URI with the same errors, then the scheme's opener is imported
    and called with it. ``settings`` maps a scheme to keyword settings for its
    opener (``{"s3": {"sse": "aws:kms"}}``, from the job spec's checkpoint
    section); only the URI's own scheme's are passed, and none if it has none.
    """
    check_uri(uri)
    scheme, entry = _scheme_of(uri)
    return _resolve(entry.opener)(uri, **dict((settings or {}).get(scheme) or {}))


def join_uri(base: str, *parts: str) -> str:
    """Join URI parts with '/' (never ``os.path.join``: it would fold ``s3://``)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


register_scheme("file", "elastic_ft.checkpoint.local:open_local")
register_scheme("s3", "elastic_ft.checkpoint.s3.store:S3Store.from_uri", checker="elastic_ft.checkpoint.s3.uri:parse_s3_uri")


__all__ = [
    "BlobMismatch",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "StoreError",
    "StoreUnavailable",
    "UnsupportedURI",
    "check_blob",
    "check_key",
    "check_uri",
    "join_uri",
    "open_store",
    "register_scheme",
    "registered_schemes",
]
