"""A store seen under a key prefix: the run's store, narrowed to one of its sub-trees.

What lives beside the checkpoints in a run's location and is committed the same
way (blobs, then a manifest written last; :mod:`elastic_ft.checkpoint.writer`),
such as a token store under ``tokens/<identity>/``, uses this view, so its keys
are the checkpoint protocol's own (``blobs/...``, ``manifests/...``) without
mixing with the run's checkpoints: gc, ``ckpt ls`` and resume list only the
root's ``manifests/`` and ``blobs/``.
"""

from __future__ import annotations

from elastic_ft.checkpoint.segments import Data
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore, check_key


class PrefixedStore(ObjectStore):
    """``store``'s objects whose keys start with ``prefix`` (``'a/b/'``), keyed without it. Closing it leaves
    ``store`` open (the caller owns it)."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        check_key(prefix.rstrip("/"))
        self.store, self.prefix = store, prefix.rstrip("/") + "/"
        self.uri = store.join(self.prefix.rstrip("/"))

    def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        self.store.put(self.prefix + key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes | memoryview:
        return self.store.get(self.prefix + key)

    def get_verified(self, key: str, *, size: int, sha256: str, chunk_size: int = 0) -> bytes | memoryview:
        return self.store.get_verified(self.prefix + key, size=size, sha256=sha256, chunk_size=chunk_size)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        n = len(self.prefix)
        return [ObjectInfo(o.key[n:], o.size, o.mtime) for o in self.store.list(self.prefix + prefix)]

    def delete(self, key: str) -> None:
        self.store.delete(self.prefix + key)


__all__ = ["PrefixedStore"]
