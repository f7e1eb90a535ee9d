"""Run one function on several threads at once, as concurrent nodes or clients."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def run_in_threads(fn: Callable[[int], T], n: int) -> list[T]:
    """``fn(i)`` for ``i`` in ``0..n-1``, each on its own thread; the results in order.

    Raises the first exception any thread raised, once all have finished.
    """
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
