"""The node cache's work directories and locks for the token store (:mod:`elastic_ft.train.token_build`).

Several ranks of a node share the node's copy of a store under a file lock; a build's or a fetch's work
directory is locked while in use, so what a killed process left behind is found (its lock is free: the
kernel releases a dead process's) and removed. Cost: a listing of the node cache's store directory per start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator

log = logging.getLogger(__name__)


SCRATCH = (".build-", ".fetch-")
"""Name prefixes of the node cache's work directories (a build's parts and store, a fetch in progress)."""


@contextlib.contextmanager
def scratch(node_root: str, name: str) -> Iterator[str]:
    """A work directory ``<node_root>/<name>`` (``name`` starts with one of :data:`SCRATCH`), held under a
    file lock while in use and removed after. A process killed while it holds one (a rank lost mid-build)
    leaves it behind; :func:`sweep_scratch` removes it once its lock is free."""
    path = os.path.join(node_root, name)
    with locked(path + ".lock"):
        try:
            os.makedirs(path, exist_ok=True)
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(path + ".lock")


def sweep_scratch(node_root: str) -> int:
    """Remove the work directories of the node cache that no live process holds (their lock is free: the
    kernel releases a dead process's); how many. Cost: one listing of the node cache's store directory."""
    try:
        names = [n for n in os.listdir(node_root) if n.startswith(SCRATCH) and not n.endswith(".lock")]
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names:
        path = os.path.join(node_root, name)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use by a live build or fetch
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(path + ".lock")
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("token store: removed %d work directorie(s) that lost builds or fetches left in %s", removed,
                 node_root)
    return removed


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


__all__ = ["SCRATCH", "locked", "scratch", "sweep_scratch"]
