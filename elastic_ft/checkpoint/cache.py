"""A node-local cache of checkpoint blobs in front of the run's store.

A worker restarted on a node that just wrote or loaded the committed
checkpoint need not download it again: blobs are immutable (each save writes
new keys, ``blobs/<step>-<nonce>/...``), so a local copy of a key is that
blob, and it is used only after its size and digest match what the manifest
records, exactly as a download is checked. Anything wrong with the copy
(missing, short, altered, unreadable) means the store is read instead, and the
copy is replaced. Manifests are never cached: whether a checkpoint exists, and
which bytes it holds, is always decided by the store.

The cache keeps the blobs of the :data:`KEEP_STEPS` checkpoints it wrote to
or loaded into last; older ones are deleted when another one arrives. Several ranks on a
node share one cache: a put is atomic (write-temp + rename), and a copy
deleted under a reader is read from the store instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.segments import Data
from elastic_ft.checkpoint.errors import ObjectNotFound
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore, check_blob

log = logging.getLogger(__name__)

BLOB_PREFIX = "blobs/"
KEEP_STEPS = 2
"""Checkpoints whose blobs stay cached: the last one written or loaded, and the one before (a fallback)."""


def _step_dir(key: str) -> str | None:
    """``blobs/<step>-<nonce>`` for a blob key, else None (manifests and anything else are not cached)."""
    parts = key.split("/")
    return "/".join(parts[:2]) if key.startswith(BLOB_PREFIX) and len(parts) > 2 else None


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # pruned by another rank meanwhile: it is read from the store next time


class CachedStore(ObjectStore):
    """``store`` with blob reads served from, and blob writes copied to, the directory ``cache_dir``.

    Every cache failure is logged and leaves the store's answer in charge:
    the cache can make a load faster, never different or less available.
    """

    def __init__(self, store: ObjectStore, cache_dir: str) -> None:
        self.store = store
        self.local = LocalStore(cache_dir)
        self.uri = store.uri
        self._pruning = threading.Lock()  # the saver puts blobs from several threads
        self.hits = 0
        """Blobs served from the cache (verified) by this process."""

    def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        self.store.put(key, data, if_absent=if_absent)
        if _step_dir(key) is not None:
            self._keep(key, data)

    def get(self, key: str) -> bytes | memoryview:
        return self.store.get(key)

    def get_verified(self, key: str, *, size: int, sha256: str, chunk_size: int = 0) -> bytes | memoryview:
        if _step_dir(key) is not None:
            try:
                data = self.local.get(key)
                check_blob(key, data, size=size, sha256=sha256, chunk_size=chunk_size)
            except ObjectNotFound:
                pass  # not on this node
            except Exception as exc:  # altered or unreadable: the store decides
                log.warning("local checkpoint cache: %s; reading it from %s", exc, self.store.uri)
            else:
                self.hits += 1
                _touch(os.path.join(self.local.root, *key.split("/")[:2]))  # loaded last: kept longest
                return data
        data = self.store.get_verified(key, size=size, sha256=sha256, chunk_size=chunk_size)
        if _step_dir(key) is not None:
            self._keep(key, data)
        return data

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.store.list(prefix)

    def delete(self, key: str) -> None:
        self.store.delete(key)
        if _step_dir(key) is not None:
            self.local.delete(key)

    def close(self) -> None:
        self.store.close()

    def _keep(self, key: str, data: Data) -> None:
        """Copy a blob into the cache and drop the steps past :data:`KEEP_STEPS`; failures only logged."""
        try:
            self.local.put(key, data)
            with self._pruning:
                self._prune(keep=_step_dir(key).split("/")[1])  # type: ignore[union-attr]
        except Exception as exc:  # a full or broken local disk costs only the next download
            log.warning("local checkpoint cache: keeping %s failed: %s", key, exc)

    def _prune(self, keep: str) -> None:
        """Delete the steps written or loaded longest ago, past :data:`KEEP_STEPS`, never ``keep``.

        Newest written or loaded last: a resume from an older step must not
        lose its blobs to the orphans of a newer save that never committed.
        A step leaves by an atomic rename before it is deleted: deleting files
        in place would make its directory look newest to a concurrent prune
        (here or in another rank's process), which would then drop the steps
        meant to stay.
        """
        blobs = os.path.join(self.local.root, BLOB_PREFIX)
        ages = {}
        for name in os.listdir(blobs):
            if name.startswith(".gone-"):
                shutil.rmtree(os.path.join(blobs, name), ignore_errors=True)  # a prune cut short by a crash
            elif not name.startswith("."):
                try:
                    ages[name] = os.path.getmtime(os.path.join(blobs, name))
                except FileNotFoundError:
                    pass  # pruned by another rank meanwhile
        for name in sorted(ages, key=ages.__getitem__)[:-KEEP_STEPS]:
            if name == keep:
                continue
            gone = os.path.join(blobs, f".gone-{uuid.uuid4().hex}")
            try:
                os.rename(os.path.join(blobs, name), gone)
            except FileNotFoundError:
                continue  # another rank took it
            shutil.rmtree(gone, ignore_errors=True)
