"""Packing: which samples share a ``max_length`` row, decided once when the token store is built.

:func:`pack` places whole samples (already cut at ``max_length``) into rows of
at most ``max_length`` tokens by best-fit decreasing: samples in decreasing
length (ties by index), each into the open row whose free space fits it most
tightly (ties: the row opened last), a new row when none fits. It reads only
the samples' lengths and is deterministic, so every world that builds the
store gets the same rows (the store's bytes do not depend on the world).

Why best-fit decreasing rather than concatenating and cutting (the old
``packing``) or first-fit in the data's order: no sample is split, so no
sample's tokens see another's and none is lost at a cut; sorted placement
fills rows as tightly as the lengths allow, which first-fit in order does not
when long samples arrive late (bench/data.py at 100k samples: 84,116 rows,
0.874 full, most samples being longer than half a row; figures in the README).

The rows are the unit the cursor deals when packing (a packed row is one
"sample" of the global order, as TRL counts packed sequences), and every sample
is in exactly one row, so "every row exactly once" is "every sample exactly once".

Cost: at build time only, O(samples log samples) for the sort plus one Python
loop over the samples with O(log max_length) work each (a few seconds per
million samples); the result is two int64 arrays in the store, memory-mapped
like the tokens, so a restart reads nothing that grows with the dataset.
"""

from __future__ import annotations

import bisect

import numpy as np


def pack(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of whole samples: ``(row_offsets, row_samples)``, int64.

    Row ``r`` holds samples ``row_samples[row_offsets[r]:row_offsets[r + 1]]`` (ascending indices, each sample
    in exactly one row); rows are numbered in the order they are opened. Raises ValueError for a sample
    longer than ``max_length`` (the caller cuts samples first).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n and (lengths.max() > max_length or lengths.min() < 0):
        raise ValueError(f"pack: sample lengths must be 0 .. {max_length} (max_length); "
                         f"got {int(lengths.min())} .. {int(lengths.max())}")
    # Decreasing length, ties by index: a stable sort of the negated lengths.
    order = np.argsort(-lengths, kind="stable")
    row_of = np.empty(n, dtype=np.int64)
    # Open rows bucketed by their free space: free[r] is a stack of row ids with r tokens free, and
    # `spaces` the sorted list of the r whose stack is not empty (at most max_length entries, so a
    # bisect and an insort cost O(max_length) bytes moved at worst, never O(rows)).
    free: dict[int, list[int]] = {}
    spaces: list[int] = []
    rows = 0
    for sample, length in zip(order.tolist(), lengths[order].tolist()):
        at = bisect.bisect_left(spaces, length)
        if at < len(spaces):
            space = spaces[at]
            stack = free[space]
            row = stack.pop()
            if not stack:
                del spaces[at]
                del free[space]
        else:
            row, space = rows, max_length
            rows += 1
        row_of[sample] = row
        left = space - length
        if left:
            stack = free.get(left)
            if stack is None:
                free[left] = stack = []
                bisect.insort(spaces, left)
            stack.append(row)
    row_samples = np.argsort(row_of, kind="stable").astype(np.int64)
    row_offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=rows), out=row_offsets[1:])
    return row_offsets, row_samples


__all__ = ["pack"]
