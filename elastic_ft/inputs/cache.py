"""The node-local cache of fetched inputs: one entry per URI, filled under a file lock, renamed into place.

Layout under the cache root, for each URI (``NAME`` is the bucket and a
digest of the URI, so nested prefixes and a file inside a cached prefix are
separate entries that never share a file):

- ``NAME/``: the object as ``NAME/<its file name>`` (a data file keeps its
  name, so its format is still inferred from the extension), or every object
  under the prefix at its relative path (a model directory);
- ``NAME.json``: per file, the ETag and size of the object it was downloaded
  from, its digest (chunked sha256, taken as its bytes landed) and its stat
  stamp (size, mtime, ctime, inode, device) once that digest held (written
  after each file lands);
- ``NAME.lock``: held (``fcntl.flock``, exclusive) while the entry is checked
  and filled, and holding the holder's host, pid and since when. The local
  ranks of a node start together and all resolve the same inputs: the first
  downloads, the others wait, then find the entry current and reuse it. The
  kernel releases the lock of a killed process; a download it left
  half-written is a temp file, removed as a stray. A waiter polls the lock
  (``LOCK_NB``), logs who holds it, and gives up after
  ``inputs.lock_timeout_s`` with an error naming the holder: on a shared
  filesystem a dead holder's lock may outlive it.

A file is downloaded to ``<path>.eft-part-<pid>``, fsynced, then renamed over
``<path>``, so no reader ever opens a half-written file. Files under the entry
that the prefix no longer holds are removed, so the directory is exactly the
prefix. Whether a copy is reused is :mod:`.plan`'s decision.

Cost: a first fetch, the download (parallel ranged GETs for large files:
:mod:`.remote`); a start that finds every file current, one HEAD or LIST and a
stat per file, since a file whose stamp is the one recorded with its digest
is trusted without reading it (``inputs.verify: sha256``); a file whose stamp
moved (touched, copied, written in place) is hashed again, ``pread`` a chunk at
a time on a few threads, and fetched again if its digest differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator

from elastic_ft.checkpoint.digest import HASH_THREADS, file_blob_sha256
from elastic_ft.checkpoint.s3.errors import ObjectChanged
from elastic_ft.checkpoint.errors import StoreUnavailable
from elastic_ft.checkpoint.stamp import file_stamp
from elastic_ft.inputs.plan import (
    Record, RemoteObject, bounds_problem, digest_needed, records_from_json, records_to_json, reuse_problem,
    stale_files,
)
from elastic_ft.inputs.remote import DIGEST_CHUNK, RemoteInputs
from elastic_ft.inputs.settings import InputsConfig
from elastic_ft.inputs.uri import InputRefused, S3Location, parse_object_uri, parse_prefix_uri

log = logging.getLogger(__name__)

# Whole re-plans when an object changes between its HEAD/LIST and its GET.
_REPLANS = 3

LOCK_POLL_S = 0.2
"""How often a waiter tries a cache entry's lock again (a fetch takes seconds to minutes)."""
LOCK_LOG_EVERY_S = 60.0
"""How often a waiter says again who holds the lock it waits for."""


class CacheLockTimeout(StoreUnavailable):
    """A cache entry's lock was held by another process for longer than ``inputs.lock_timeout_s``."""


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A resolved input: its local ``path``, and the files (relative paths) this call downloaded."""

    path: str
    fetched: list[str]


class InputCache:
    """Inputs of ``remote`` cached under ``root``, bounded and verified by ``settings``."""

    def __init__(self, root: str, remote: RemoteInputs, settings: InputsConfig) -> None:
        self.root, self.remote, self.settings = root, remote, settings

    def fetch_file(self, uri: str) -> Fetched:
        """The local copy of the object ``s3://bucket/key``, fetched unless a verified copy is cached."""
        loc = parse_object_uri(uri)
        name = os.path.basename(loc.key)
        return self._fill(loc, lambda: [self.remote.head(loc, name)], os.path.join(self._entry(loc), name))

    def fetch_dir(self, uri: str) -> Fetched:
        """The local copy of every object under ``s3://bucket/prefix/``, as one directory."""
        loc = parse_prefix_uri(uri)

        def listing() -> list[RemoteObject]:
            objects = self.remote.list(loc, self.settings.max_model_files)
            if not objects:
                raise InputRefused(f"{loc.uri} holds no objects; upload the model directory there first")
            return objects

        return self._fill(loc, listing, self._entry(loc))

    def _entry(self, loc: S3Location) -> str:
        return os.path.join(self.root, f"{loc.bucket}-{hashlib.sha256(loc.uri.encode()).hexdigest()[:16]}")

    def _fill(self, loc: S3Location, plan, path: str) -> Fetched:
        entry = self._entry(loc)
        with self._locked(entry):
            for attempt in range(1, _REPLANS + 1):
                objects = plan()
                problem = bounds_problem(objects, max_file_bytes=self.settings.max_file_bytes,
                                         max_total_bytes=self.settings.max_model_bytes)
                if problem:
                    raise InputRefused(f"{loc.uri} is refused: {problem}")
                try:
                    return Fetched(path, self._sync(loc, entry, objects))
                except ObjectChanged:
                    log.warning("%s changed while it was being fetched (attempt %d of %d); listing it again",
                                loc.uri, attempt, _REPLANS)
        raise StoreUnavailable(f"{loc.uri} changed during each of {_REPLANS} fetches; "
                               "wait until it is no longer being written, then retry")

    @contextlib.contextmanager
    def _locked(self, entry: str) -> Iterator[None]:
        os.makedirs(self.root, exist_ok=True)
        with entry_lock(entry + ".lock", timeout_s=self.settings.lock_timeout_s):
            yield

    def _sync(self, loc: S3Location, entry: str, objects: list[RemoteObject]) -> list[str]:
        """Make ``entry`` hold exactly ``objects``, downloading those without a verified copy."""
        records = _read_records(entry + ".json")
        for rel in stale_files(_local_files(entry), (o.rel for o in objects)):
            os.remove(os.path.join(entry, rel))  # strays: temp files of a killed fetch, files gone from S3
            records.pop(rel, None)
        todo, restamped = [], False
        for obj in objects:
            reason, checked = self._check(entry, obj, records.get(obj.rel))
            if reason:
                todo.append((obj, reason))
            elif checked is not None:  # hashed again and intact: stamped as it is now
                records[obj.rel] = checked
                restamped = True
        if restamped:  # one write for every file hashed again (a copied model directory: all of them)
            _write_records(entry + ".json", loc.uri, records)
        _check_space(entry, loc.uri, sum(o.size for o, _ in todo))
        for obj, reason in todo:
            log.info("fetching s3://%s/%s (%d bytes): %s", loc.bucket, obj.key, obj.size, reason)
            records[obj.rel] = self._download(loc.bucket, entry, obj)
            _write_records(entry + ".json", loc.uri, records)
        if not todo:
            log.info("%s: using the verified copy cached in %s", loc.uri, entry)
        return [o.rel for o, _ in todo]

    def _check(self, entry: str, obj: RemoteObject, record: Record | None) -> tuple[str | None, Record | None]:
        """Why the cached copy of ``obj`` cannot be reused (None: it can), and its record re-stamped when
        it had to be hashed again to be trusted (None: the record stands)."""
        path = _inside(entry, obj.rel)
        local_size = os.path.getsize(path) if os.path.isfile(path) else None
        problem = reuse_problem(obj, record, local_size)
        if problem is not None or record is None or self.settings.verify != "sha256":
            return problem, None
        before = _stamp_or_none(path)
        if not digest_needed(record, before):
            return None, None  # untouched since its digest was known to hold
        actual = _file_digest(path, record)
        if actual != record.sha256:
            return "the cached file's digest differs from the one recorded at download", None
        if _stamp_or_none(path) != before:  # written while hashed: trust it now, stamp it next time
            return None, None
        return None, dataclasses.replace(record, stamp=tuple(before))

    def _download(self, bucket: str, entry: str, obj: RemoteObject) -> Record:
        path = _inside(entry, obj.rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.isdir(path):
            shutil.rmtree(path)  # a prefix that was a directory here is now a file
        tmp = f"{path}.eft-part-{os.getpid()}"
        try:
            digest = self.remote.download(bucket, obj, tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        _fsync_dir(os.path.dirname(path))
        # Stamped after the rename (which may move ctime): the bytes hashed as they landed are these.
        return Record(etag=obj.etag, size=obj.size, sha256=digest, chunk_size=DIGEST_CHUNK,
                      stamp=tuple(file_stamp(path)))


@contextlib.contextmanager
def entry_lock(path: str, *, timeout_s: float) -> Iterator[None]:
    """Hold the lock file ``path`` (``fcntl.flock``, exclusive; the kernel releases it if this process dies).

    Polled with ``LOCK_NB`` every :data:`LOCK_POLL_S`: a waiter logs who holds it (the holder writes its
    host, pid and since when into the file once it has it), again every :data:`LOCK_LOG_EVERY_S`, and
    raises :class:`CacheLockTimeout` naming the holder after ``timeout_s``.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        start = time.monotonic()
        next_log = start
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            now, holder = time.monotonic(), _holder(fd)
            if now - start >= timeout_s:
                raise CacheLockTimeout(
                    f"the input cache's lock {path} is still held after {timeout_s:g} s (inputs.lock_timeout_s) "
                    f"by {holder}; if that process is gone (a node that died on a shared filesystem), remove "
                    f"the lock file, else raise inputs.lock_timeout_s")
            if now >= next_log:
                log.info("waiting for the input cache's lock %s, held by %s (%.0f s of %g s)", path, holder,
                         now - start, timeout_s)
                next_log = now + LOCK_LOG_EVERY_S
            time.sleep(min(LOCK_POLL_S, max(0.0, start + timeout_s - now)))
        # Ours now: say who holds it, for the next waiter's log (a lock file is never read for anything else).
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time(), 3)})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock open as ``fd``, as its file says (read without the lock: perhaps half-written)."""
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"null")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        return f"host {doc['host']} pid {int(doc['pid'])} (since {since})"
    except (OSError, ValueError, TypeError, KeyError):
        return "a process that has not written its name into it"


def _stamp_or_none(path: str) -> list[int] | None:
    try:
        return file_stamp(path)
    except OSError:
        return None


def _file_digest(path: str, record: Record) -> str | None:
    """The digest of the file at ``path`` as ``record``'s was taken (None: it is gone or shorter than
    recorded). A read error (EIO, a network filesystem's hiccup) is raised, never taken for a changed
    file: that would throw a verified copy away and fetch it again whole on a fault that may pass."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return file_blob_sha256(fd, 0, record.size, record.chunk_size, threads=HASH_THREADS)
    except ValueError:  # shorter than recorded
        return None
    finally:
        os.close(fd)


def _inside(entry: str, rel: str) -> str:
    """``entry/rel``, refusing one that resolves outside ``entry`` (keys were checked; this is the backstop)."""
    path = os.path.join(entry, rel)
    real_entry = os.path.realpath(entry)
    if os.path.commonpath([real_entry, os.path.realpath(path)]) != real_entry or os.path.isabs(rel):
        raise InputRefused(f"key {rel!r} would leave the cache directory {entry}; refusing it")
    return path


def _local_files(entry: str) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(entry):
        out.extend(os.path.relpath(os.path.join(dirpath, f), entry) for f in files)
    return out


def _check_space(entry: str, uri: str, needed: int) -> None:
    if needed == 0:
        return
    os.makedirs(entry, exist_ok=True)
    free = shutil.disk_usage(entry).free
    if free < needed:
        raise InputRefused(f"{uri} needs {needed} bytes in the input cache {entry} but only {free} are free; "
                           "free space there or set inputs.cache_dir to a larger disk")


def _read_records(path: str) -> dict[str, Record]:
    try:
        with open(path, encoding="utf-8") as f:
            return records_from_json(json.load(f))
    except (OSError, ValueError):
        return {}  # no record, or an unreadable one: every file is fetched again


def _write_records(path: str, uri: str, records: dict[str, Record]) -> None:
    tmp = f"{path}.eft-part-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(records_to_json(uri, records), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["CacheLockTimeout", "Fetched", "InputCache", "entry_lock"]
