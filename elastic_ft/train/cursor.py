"""Data order: which samples a step takes, as pure functions of (seed, epoch, cursor).

The global sample order is a fixed permutation of dataset indices per (seed,
epoch); the only data state a run keeps is the global cursor (samples consumed
since the start). A step takes the next ``global_batch`` positions of that
order and deals them to whatever ranks exist now. No rank owns a shard, so a
restart at any world size continues the identical sequence: every sample
exactly once per epoch.
"""

from __future__ import annotations

import functools

import numpy as np


def order_dtype(n: int) -> np.dtype:
    """The smallest unsigned integer type that holds every index of ``range(n)``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if n - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation of ``range(n)`` used for ``epoch``, as a read-only array.

    numpy's PCG64 seeded with the pair (seed, epoch): its stream is stable
    across numpy releases (NEP 19), unlike ``torch.randperm`` across devices.
    Kept as one array of :func:`order_dtype` (4 bytes per sample below 2**32
    samples; at most 4 epochs cached), never as a Python int per sample, so a
    restart's cost is one numpy shuffle of ``n`` (tens of ms per million samples
    on a 2-core machine, bench/data.py) and no Python object that grows with the
    dataset. Read-only
    because the cached object is shared by every caller.
    """
    if n <= 0:
        raise ValueError(f"the dataset is empty (n={n}); check data.files and data.max_length")
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    # What rng.permutation(n) does (arange, then shuffle in place), in the small
    # type from the start: the same draws, so the same order, without its
    # 8-byte-per-sample int64 copy at the peak of a restart.
    order = np.arange(n, dtype=order_dtype(n))
    rng.shuffle(order)
    order.flags.writeable = False
    return order


def take(cursor: int, count: int, n: int, seed: int) -> list[tuple[int, int]]:
    """The (epoch, dataset index) of global positions ``cursor .. cursor+count-1``.

    A batch may straddle an epoch boundary: it ends one epoch's order and
    starts the next one's, so no sample is dropped or repeated at the seam.
    Builds nothing but the ``count`` pairs it returns (Python ints), reading
    each epoch's order array it touches in place (a step's batch is bounded
    by the dataset size before training starts: scaling.total_steps). Raises
    ValueError for a negative ``cursor`` or ``count``.
    """
    if cursor < 0 or count < 0:
        raise ValueError(f"take: cursor ({cursor}) and count ({count}) must be >= 0")
    if count and n <= 0:
        epoch_order(seed, 0, n)  # raises the empty-dataset error
    out: list[tuple[int, int]] = []
    pos, end = cursor, cursor + count
    while pos < end:
        epoch, offset = divmod(pos, n)
        stop = min(n, offset + (end - pos))  # this epoch's part of the batch ends here
        order = epoch_order(seed, epoch, n)
        out.extend((epoch, i) for i in order[offset:stop].tolist())
        pos += stop - offset
    return out


def deal(items: list, sizes: tuple[int, ...] | list[int]) -> list[list]:
    """Split ``items`` into consecutive slices of the given sizes (one per rank)."""
    if sum(sizes) != len(items):
        raise ValueError(f"cannot deal {len(items)} items into slices of {list(sizes)}")
    out, start = [], 0
    for size in sizes:
        out.append(items[start : start + size])
        start += size
    return out
