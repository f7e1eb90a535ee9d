"""Data order (elastic_ft.train.cursor): permutations, the cursor across epochs
and restarts at other world sizes, and the deal to ranks."""

import numpy as np
import pytest

from elastic_ft.config import BatchConfig
from elastic_ft.train.cursor import deal, epoch_order, order_dtype, take
from elastic_ft.train.scaling import plan_batch


def test_epoch_order_is_a_deterministic_permutation():
    order = epoch_order(7, 0, 100)
    assert sorted(order.tolist()) == list(range(100))
    assert order.tolist() != list(range(100))
    epoch_order.cache_clear()
    again = epoch_order(7, 0, 100)
    assert again is not order and np.array_equal(again, order)  # recomputed, not the cached object


def test_epoch_order_differs_by_seed_and_epoch():
    base = epoch_order(1, 0, 50)
    assert not np.array_equal(epoch_order(2, 0, 50), base)
    assert not np.array_equal(epoch_order(1, 1, 50), base)
    assert sorted(epoch_order(1, 1, 50).tolist()) == list(range(50))


def _old_epoch_order(seed, epoch, n):
    """The order as it was first defined (a tuple of Python ints): runs that resume must keep it, bit for bit."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return tuple(int(i) for i in rng.permutation(n))


@pytest.mark.parametrize("seed,epoch,n", [(0, 0, 1), (1234, 0, 256), (1234, 3, 257), (7, 1, 65_536),
                                          (7, 2, 65_537), (2**40 + 5, 9, 100_003)])
def test_epoch_order_is_the_old_tuple_kept_as_one_read_only_array(seed, epoch, n):
    # A restart used to build one Python int per sample (about 36 MB per epoch at
    # a million samples): the cached order is one array, no list or tuple.
    order = epoch_order(seed, epoch, n)
    assert isinstance(order, np.ndarray) and not order.flags.writeable
    assert order.dtype == order_dtype(n) and order.dtype.itemsize * n == order.nbytes
    assert tuple(order.tolist()) == _old_epoch_order(seed, epoch, n)
    assert [i for _, i in take(epoch * n, n, n, seed)] == list(_old_epoch_order(seed, epoch, n))
    assert all(type(i) is int for _, i in take(max(0, epoch * n + n - 3), 5, n, seed))  # JSON- and torch-safe
    with pytest.raises(ValueError, match="read-only"):
        order[0] = 0


@pytest.mark.parametrize("n,dtype", [(1, np.uint8), (256, np.uint8), (257, np.uint16), (65_536, np.uint16),
                                     (65_537, np.uint32), (2**32, np.uint32), (2**32 + 1, np.uint64)])
def test_order_dtype_is_the_smallest_that_holds_every_index(n, dtype):
    assert order_dtype(n) == np.dtype(dtype)


def test_epoch_order_rejects_empty_dataset():
    with pytest.raises(ValueError, match="empty"):
        epoch_order(0, 0, 0)


def test_take_within_and_across_epochs():
    n, seed = 10, 3
    e0, e1 = epoch_order(seed, 0, n), epoch_order(seed, 1, n)
    assert take(0, 4, n, seed) == [(0, i) for i in e0[:4].tolist()]
    got = take(8, 5, n, seed)
    assert got == [(0, int(e0[8])), (0, int(e0[9])), (1, int(e1[0])), (1, int(e1[1])), (1, int(e1[2]))]
    # two whole epochs: each sample exactly once in each
    both = take(0, 2 * n, n, seed)
    assert sorted(i for e, i in both if e == 0) == list(range(n))
    assert sorted(i for e, i in both if e == 1) == list(range(n))
    assert take(5, 0, n, seed) == []


def _take_by_definition(cursor, count, n, seed):
    """The definition take() must keep: position p is epoch p // n, index order[p % n]."""
    return [(p // n, int(epoch_order(seed, p // n, n)[p % n])) for p in range(cursor, cursor + count)]


@pytest.mark.parametrize("cursor,count,n", [(0, 1, 1), (0, 7, 7), (3, 4, 7), (5, 30, 7), (69, 1, 7), (14, 0, 7),
                                            (123, 250, 50), (0, 1, 1000)])
def test_take_matches_its_definition(cursor, count, n):
    assert take(cursor, count, n, seed=5) == _take_by_definition(cursor, count, n, seed=5)


def test_take_refuses_negative_positions_and_empty_data():
    # A negative count used to return an empty batch silently (a step that trained on nothing).
    with pytest.raises(ValueError, match=r"cursor \(0\) and count \(-1\) must be >= 0"):
        take(0, -1, 10, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        take(-3, 2, 10, 0)
    with pytest.raises(ValueError, match="empty"):
        take(0, 1, 0, 0)


def _consume(segments, n, seed):
    """Run the cursor through restarts: each segment is (world, global_batch, steps).
    Returns what the ranks processed, in rank order per step, and the final cursor."""
    cursor, seen = 0, []
    for world, global_batch, steps in segments:
        plan = plan_batch(BatchConfig(global_batch=global_batch, micro_batch=3), 1e-3, world)
        for _ in range(steps):
            positions = take(cursor, plan.global_batch, n, seed)
            per_rank = deal(positions, plan.per_rank)
            assert [len(p) for p in per_rank] == list(plan.per_rank)
            for mine in per_rank:
                seen.extend(mine)
            cursor += plan.global_batch
    return seen, cursor


def test_restarts_at_other_worlds_and_batches_continue_the_same_sequence():
    n, seed = 37, 11
    segments = [(2, 8, 3), (1, 5, 4), (3, 16, 2), (16, 16, 1), (5, 7, 3)]
    seen, cursor = _consume(segments, n, seed)
    assert cursor == 8 * 3 + 5 * 4 + 16 * 2 + 16 + 7 * 3
    assert seen == take(0, cursor, n, seed)
    # and it spans epochs: every finished epoch holds each sample once
    for epoch in range(cursor // n):
        assert sorted(i for e, i in seen if e == epoch) == list(range(n))


def test_uninterrupted_and_restarted_runs_agree():
    n, seed = 64, 0
    one_pass, c1 = _consume([(1, 8, 12)], n, seed)
    restarted, c2 = _consume([(2, 8, 5), (1, 8, 2), (3, 8, 5)], n, seed)
    assert c1 == c2 and one_pass == restarted


def test_deal_uneven_sizes():
    items = list("abcdefg")
    assert deal(items, (3, 2, 2)) == [["a", "b", "c"], ["d", "e"], ["f", "g"]]
    assert deal(items, [7]) == [items]
    assert deal(items, (1, 0, 6)) == [["a"], [], list("bcdefg")]


@pytest.mark.parametrize("sizes", [(3, 3), (4, 4), ()])
def test_deal_size_mismatch_raises(sizes):
    with pytest.raises(ValueError, match=r"cannot deal 7 items"):
        deal(list(range(7)), sizes)
