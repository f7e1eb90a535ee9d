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
import errno
import os
import stat
import tempfile
import urllib.parse

from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.segments import Data, as_segments
from elastic_ft.filemode import default_file_mode


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
    """The checkpoint URI's scheme has no backend."""


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


class BlobMismatch(StoreError):
    """A blob's bytes do not match the size or sha256 its manifest recorded."""


def check_blob(key: str, data: bytes | memoryview, *, size: int, sha256: str, chunk_size: int = 0) -> None:
    """Raise :class:`BlobMismatch` naming ``key`` unless ``data`` has ``size`` and digest ``sha256``
    (chunked by ``chunk_size``: :mod:`elastic_ft.checkpoint.digest`)."""
    if len(data) != size:
        raise BlobMismatch(f"blob {key!r} has {len(data)} bytes but its manifest records {size}")
    actual = blob_sha256(data, chunk_size, threads=os.cpu_count() or 1)
    if actual != sha256:
        raise BlobMismatch(f"blob {key!r} has sha256 {actual[:16]}… but its manifest records {sha256[:16]}…")


class LocalStore(ObjectStore):
    """``file://`` store: one file per key under a root directory.

    Atomic put is write-temp + fsync + rename (+ fsync of the directory, so the
    rename itself survives a power cut). ``if_absent`` uses ``os.link`` of the
    temp file, which fails if the target exists: the same create-if-absent that
    S3's ``If-None-Match: *`` gives, without a check-then-rename race. Objects
    get the mode the umask implies (``mkstemp`` alone would leave them 0600).

    Errors: a missing file is :class:`ObjectNotFound`; any other ``OSError``
    (EIO, EACCES, ENOSPC, a directory where an object's file should be, a file
    where a directory should be) is :class:`StoreUnavailable`: the disk could not
    answer, which says nothing about the checkpoint.
    """

    def __init__(self, root: str, *, uri: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.uri = uri or f"file://{self.root}"

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise StoreError(f"invalid object key {key!r}: keys are '/'-separated names without '.' or '..'")
        return os.path.join(self.root, *parts)

    def _unavailable(self, what: str, key: str, exc: OSError) -> StoreUnavailable:
        """The domain error for an ``OSError`` other than a missing file: names the object, the cause, what to do."""
        name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        return StoreUnavailable(
            f"{what} of {self.join(key)} failed: {exc.strerror or exc} ({name}); "
            "check the filesystem (permissions, free space, disk health) and retry"
        )

    def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
        except OSError as exc:
            raise self._unavailable("put", key, exc) from exc
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), default_file_mode())  # as open() would: readable on a shared filesystem
                for buf in as_segments(data).buffers:
                    f.write(buf)
                f.flush()
                os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError as exc:
                    raise ObjectExists(f"{self.join(key)} already exists") from exc
            else:
                os.replace(tmp, path)
            _fsync_dir(directory)
        except OSError as exc:
            raise self._unavailable("put", key, exc) from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get(self, key: str) -> bytes:
        return self._read(key, size=None)

    def get_verified(self, key: str, *, size: int, sha256: str, chunk_size: int = 0) -> bytes:
        """As :meth:`ObjectStore.get_verified`, but the file's size is checked before
        it is read: a manifest's size is never trusted to size anything."""
        data = self._read(key, size=size)
        check_blob(key, data, size=size, sha256=sha256, chunk_size=chunk_size)
        return data

    def _read(self, key: str, *, size: int | None) -> bytes:
        """The file's bytes; with ``size``, :class:`BlobMismatch` first if the file has another size."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                actual = os.fstat(f.fileno()).st_size
                if size is not None and actual != size:
                    raise BlobMismatch(f"blob {key!r} has {actual} bytes but its manifest records {size}")
                return f.read()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.join(key)} does not exist") from exc
        except OSError as exc:
            raise self._unavailable("get", key, exc) from exc

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """As :meth:`ObjectStore.list`; a root that does not exist yet lists empty.

        An unreadable directory raises :class:`StoreUnavailable` rather than
        being skipped: a listing that silently misses files would prove blobs
        missing that are there.
        """
        try:
            if not stat.S_ISDIR(os.stat(self.root).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._unavailable("list", f"{prefix}*", exc) from exc

        def walk_error(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):  # a directory gc removed while we walked
                raise exc

        out: list[ObjectInfo] = []
        try:
            for dirpath, _dirs, files in os.walk(self.root, onerror=walk_error):
                for name in files:
                    if name.startswith(".tmp-"):
                        continue  # an in-flight or crashed put; never a visible object
                    full = os.path.join(dirpath, name)
                    key = os.path.relpath(full, self.root).replace(os.sep, "/")
                    if key.startswith(prefix):
                        try:
                            st = os.stat(full)
                        except FileNotFoundError:
                            continue  # deleted while listing
                        out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        except OSError as exc:
            raise self._unavailable("list", f"{prefix}*", exc) from exc
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._unavailable("delete", key, exc) from exc
        # Prune now-empty blob directories so a gc'd run leaves no litter.
        parent = os.path.dirname(path)
        while parent != self.root and parent.startswith(self.root):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_uri(uri: str) -> str | None:
    """The local path of a file URI (or plain path), None for S3; raises for a URI :func:`open_store` refuses.

    Opens nothing, so a command can check the URI as the user typed it before
    any work, and the message quotes exactly that: joining a run id onto a bad
    base first would garble it ('s3://' + 'run' reads 's3:/run'). A file URI
    without a path ('file://', '') is refused: joined with a run id it would
    silently mean '/run', at the filesystem root.
    """
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file"):
        if scheme == "file" and parsed.netloc not in ("", "localhost", "."):
            raise UnsupportedURI(
                f"checkpoint URI {uri!r}: file URIs must be file:///absolute/path or file://./relative/path"
            )
        path = (parsed.netloc + parsed.path) if parsed.netloc == "." else (parsed.path if scheme else uri)
        if not path:
            raise UnsupportedURI(
                f"checkpoint URI {uri!r} has no path; write file:///absolute/path or file://./relative/path"
            )
        return path
    if scheme == "s3":
        from elastic_ft.checkpoint.s3 import parse_s3_uri  # the SDK itself is imported only by a store

        parse_s3_uri(uri)
        return None
    raise UnsupportedURI(
        f"checkpoint URI {uri!r} has unsupported scheme {parsed.scheme!r}; use file:///path or s3://bucket/prefix"
    )


def open_store(uri: str) -> ObjectStore:
    """Open the store for a run's URI: ``file:///abs/dir``, a plain path, or ``s3://bucket/prefix``.

    Raises :class:`UnsupportedURI` naming the scheme for anything else (see :func:`check_uri`).
    """
    path = check_uri(uri)
    if path is not None:
        return LocalStore(path, uri=uri)
    from elastic_ft.checkpoint.s3 import S3Store  # boto3 is heavy: import only when used

    return S3Store.from_uri(uri)


def join_uri(base: str, *parts: str) -> str:
    """Join URI parts with '/' (never ``os.path.join``: it would fold ``s3://``)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


__all__ = [
    "BlobMismatch",
    "LocalStore",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "StoreError",
    "StoreUnavailable",
    "UnsupportedURI",
    "check_blob",
    "check_uri",
    "join_uri",
    "open_store",
]
