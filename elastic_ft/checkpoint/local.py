"""The ``file://`` object store: one file per key under a root directory.

Registered for ``file://`` URIs and plain paths by :mod:`elastic_ft.checkpoint.store`;
:func:`open_local` is the opener the scheme registry calls.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile

from elastic_ft.checkpoint.errors import BlobMismatch, ObjectExists, ObjectNotFound, StoreUnavailable, UnsupportedURI
from elastic_ft.checkpoint.segments import Data, as_segments
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore, check_blob, check_key, check_uri
from elastic_ft.checkpoint.filemode import default_file_mode


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
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

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


def open_local(uri: str) -> LocalStore:
    """The store of a ``file://`` URI or plain path (:func:`~elastic_ft.checkpoint.store.check_uri` gives its path)."""
    path = check_uri(uri)
    if path is None:  # the registry opens only file URIs here; a direct caller may not
        raise UnsupportedURI(f"checkpoint URI {uri!r} is not a file URI; write file:///absolute/path")
    return LocalStore(path, uri=uri)


__all__ = ["LocalStore", "open_local"]
