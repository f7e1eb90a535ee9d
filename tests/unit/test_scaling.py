"""Batch plan, LR rescale and schedule (elastic_ft.train.scaling), and the
split-independence of the gradient that ``constant_global`` promises."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from elastic_ft.config import BatchConfig, OptimizerConfig
from elastic_ft.train.cursor import deal
from elastic_ft.train.scaling import (
    BatchPlanError, lr_at, plan_batch, rescale_event, split_evenly, total_steps,
)

WORLDS = range(1, 17)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Hundreds of tiny ops: intra-op threads only contend on a busy 2-core machine (30x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- constant_global


@pytest.mark.parametrize("global_batch,micro_batch", [(16, 4), (32, 8), (17, 3), (100, 7), (16, 1)])
def test_constant_global_over_worlds(global_batch, micro_batch):
    cfg = BatchConfig(global_batch=global_batch, micro_batch=micro_batch, policy="constant_global")
    for world in WORLDS:
        if global_batch < world:
            continue
        plan = plan_batch(cfg, 3e-4, world)
        assert plan.world == world
        assert plan.global_batch == global_batch
        assert len(plan.per_rank) == world
        assert sum(plan.per_rank) == global_batch
        assert max(plan.per_rank) - min(plan.per_rank) <= 1
        assert min(plan.per_rank) >= 1
        assert plan.micro_steps == tuple(-(-n // micro_batch) for n in plan.per_rank)
        # every micro-batch but possibly the last one of a rank is full
        for n, k in zip(plan.per_rank, plan.micro_steps):
            assert (k - 1) * micro_batch < n <= k * micro_batch
        assert plan.lr == 3e-4
        assert plan.policy == "constant_global"


def test_uneven_split_example():
    plan = plan_batch(BatchConfig(global_batch=32, micro_batch=8), 1e-3, 3)
    assert plan.per_rank == (11, 11, 10)
    assert plan.micro_steps == (2, 2, 2)
    plan = plan_batch(BatchConfig(global_batch=10, micro_batch=3), 1e-3, 4)
    assert plan.per_rank == (3, 3, 2, 2)
    assert plan.micro_steps == (1, 1, 1, 1)


@pytest.mark.parametrize("global_batch,world", [(1, 2), (8, 9), (15, 16), (32, 64), (3, 35)])
def test_a_world_larger_than_the_global_batch_idles_the_ranks_beyond_it(global_batch, world):
    """A node joining a constant_global run never ends it (it raised BatchPlanError here, every rank exited 2):
    the first ``global_batch`` ranks take one sample each, the rest none, and the plan says so."""
    plan = plan_batch(BatchConfig(global_batch=global_batch, micro_batch=4), 1e-3, world)
    assert plan.per_rank == (1,) * global_batch + (0,) * (world - global_batch)
    assert plan.micro_steps == (1,) * global_batch + (0,) * (world - global_batch)
    assert plan.idle_ranks == world - global_batch and plan.global_batch == global_batch and plan.lr == 1e-3
    assert f"{world - global_batch} of {world} rank(s) idle each step" in plan.reason
    assert f"batch.global_batch ({global_batch})" in plan.reason and "\n" not in plan.reason
    # The step's samples are still dealt exactly once, whatever the world.
    assert [len(r) for r in deal(list(range(global_batch)), plan.per_rank)] == list(plan.per_rank)


def test_no_rank_idles_while_the_world_fits():
    for world in WORLDS:
        assert plan_batch(BatchConfig(global_batch=16, micro_batch=3), 1e-3, world).idle_ranks == 0
        cfg = BatchConfig(global_batch=4, micro_batch=2, policy="scale_with_world", reference_world=4)
        assert plan_batch(cfg, 1e-3, world).idle_ranks == 0  # one sample per rank at least, always


def test_the_rescale_to_a_world_beyond_the_batch_names_the_idle_ranks():
    """The 8B spec's case: 32 samples per step, 4 nodes of 8 GPUs, then an 8-node world."""
    cfg = BatchConfig(global_batch=32, micro_batch=1)
    ev = rescale_event(_saved(plan_batch(cfg, 1e-3, 32)), plan_batch(cfg, 1e-3, 64))
    assert ev["idle_ranks"] == 32 and (ev["old"]["idle_ranks"], ev["new"]["idle_ranks"]) == (0, 32)
    assert ev["changed"]["world"] == {"old": 32, "new": 64} and "32 of 64 rank(s) idle" in ev["reason"]
    # and back: the idle ranks are gone once the world fits again
    back = rescale_event(_saved(plan_batch(cfg, 1e-3, 64)), plan_batch(cfg, 1e-3, 16))
    assert back["idle_ranks"] == 0 and back["old"]["idle_ranks"] == 32


def test_world_below_one_raises():
    with pytest.raises(BatchPlanError, match="at least 1"):
        plan_batch(BatchConfig(), 1e-3, 0)


def test_split_evenly():
    assert split_evenly(7, 3) == (3, 2, 2)
    assert split_evenly(6, 3) == (2, 2, 2)
    assert split_evenly(2, 4) == (1, 1, 0, 0)


# --------------------------------------------------------------------------- scale_with_world


@pytest.mark.parametrize("reference_world", [1, 2, 4])
def test_scale_with_world_linear(reference_world):
    cfg = BatchConfig(global_batch=8 * reference_world, micro_batch=3, policy="scale_with_world",
                      lr_scaling="linear", reference_world=reference_world)
    for world in WORLDS:
        plan = plan_batch(cfg, 1e-3, world)
        assert plan.global_batch == 8 * world
        assert plan.per_rank == (8,) * world
        assert plan.micro_steps == (3,) * world
        assert plan.lr == pytest.approx(1e-3 * world / reference_world, rel=1e-12)
    assert plan_batch(cfg, 1e-3, reference_world).lr == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize("reference_world", [1, 4])
def test_scale_with_world_sqrt(reference_world):
    cfg = BatchConfig(global_batch=4 * reference_world, micro_batch=4, policy="scale_with_world",
                      lr_scaling="sqrt", reference_world=reference_world)
    for world in WORLDS:
        plan = plan_batch(cfg, 2e-4, world)
        assert plan.global_batch == 4 * world
        assert plan.lr == pytest.approx(2e-4 * math.sqrt(world / reference_world), rel=1e-12)
    assert plan_batch(cfg, 2e-4, 4 * reference_world).lr == pytest.approx(4e-4, rel=1e-12)
    assert "sqrt" in plan_batch(cfg, 2e-4, 2).reason


# --------------------------------------------------------------------------- rescale_event


def _saved(plan):
    """The plan as a manifest stores it: JSON, so tuples come back as lists."""
    return json.loads(json.dumps(plan.to_dict()))


def test_rescale_event_none_when_unchanged():
    cfg = BatchConfig(global_batch=32, micro_batch=8)
    plan = plan_batch(cfg, 1e-3, 3)
    assert rescale_event(None, plan) is None
    assert rescale_event(_saved(plan), plan) is None
    assert rescale_event(_saved(plan_batch(cfg, 1e-3, 3)), plan_batch(cfg, 1e-3, 3)) is None


def test_rescale_event_constant_global_world_change():
    cfg = BatchConfig(global_batch=32, micro_batch=8)
    old, new = plan_batch(cfg, 1e-3, 2), plan_batch(cfg, 1e-3, 3)
    ev = rescale_event(_saved(old), new)
    assert ev is not None
    assert ev["policy"] == "constant_global"
    assert set(ev["changed"]) == {"world", "per_rank", "micro_steps"}  # global batch and lr unchanged
    assert list(ev["changed"]["micro_steps"]["new"]) == [2, 2, 2]
    assert ev["changed"]["world"] == {"old": 2, "new": 3}
    assert list(ev["changed"]["per_rank"]["old"]) == [16, 16]
    assert list(ev["changed"]["per_rank"]["new"]) == [11, 11, 10]


def test_rescale_event_scale_with_world_lr_change():
    cfg = BatchConfig(global_batch=8, micro_batch=4, policy="scale_with_world", reference_world=2)
    ev = rescale_event(_saved(plan_batch(cfg, 1e-3, 2)), plan_batch(cfg, 1e-3, 4))
    assert ev["changed"]["global_batch"] == {"old": 8, "new": 16}
    assert ev["changed"]["lr"]["old"] == pytest.approx(1e-3)
    assert ev["changed"]["lr"]["new"] == pytest.approx(2e-3)
    assert ev["policy"] == "scale_with_world"


@pytest.mark.parametrize(("rule", "factor"), [("linear", 0.5), ("sqrt", math.sqrt(0.5))])
def test_rescale_event_states_both_plans_in_full(rule, factor):
    cfg = BatchConfig(global_batch=8, micro_batch=2, policy="scale_with_world", lr_scaling=rule, reference_world=2)
    ev = rescale_event(_saved(plan_batch(cfg, 1e-3, 2)), plan_batch(cfg, 1e-3, 1))
    assert ev["old"]["world"] == 2 and ev["new"]["world"] == 1
    assert (ev["old"]["global_batch"], ev["new"]["global_batch"]) == (8, 4)
    assert (ev["old"]["micro_batch"], list(ev["new"]["micro_steps"])) == (2, [2])
    assert ev["old"]["lr_factor"] == pytest.approx(1.0)
    assert ev["new"]["lr_factor"] == pytest.approx(factor)
    assert ev["new"]["lr"] == pytest.approx(1e-3 * factor)
    assert ev["old"]["policy"] == ev["new"]["policy"] == "scale_with_world"


def test_rescale_event_from_a_plan_saved_without_lr_factor():
    cfg = BatchConfig(global_batch=32, micro_batch=8)
    old = _saved(plan_batch(cfg, 1e-3, 2))
    del old["lr_factor"]  # manifests written before the field existed
    ev = rescale_event(old, plan_batch(cfg, 1e-3, 4))
    assert ev["old"]["lr_factor"] is None and ev["new"]["lr_factor"] == 1.0


# --------------------------------------------------------------------------- lr_at / total_steps


def test_lr_warmup_then_cosine():
    opt = OptimizerConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    peak, total = 1.0, 104
    assert [lr_at(s, total, peak, opt) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(4, total, peak, opt) == pytest.approx(1.0)
    assert lr_at(54, total, peak, opt) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: cos(pi/2) = 0
    assert lr_at(29, total, peak, opt) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(total, total, peak, opt) == pytest.approx(0.1)
    assert lr_at(total + 50, total, peak, opt) == pytest.approx(0.1)  # clamped past the end
    lrs = [lr_at(s, total, peak, opt) for s in range(4, total + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_lr_linear_and_constant():
    lin = OptimizerConfig(warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_at(0, 10, 2.0, lin) == pytest.approx(2.0)
    assert lr_at(5, 10, 2.0, lin) == pytest.approx(1.0)
    assert lr_at(10, 10, 2.0, lin) == pytest.approx(0.0)
    lin_floor = OptimizerConfig(warmup_steps=2, schedule="linear", min_lr_ratio=0.5)
    assert lr_at(0, 12, 2.0, lin_floor) == pytest.approx(1.0)
    assert lr_at(7, 12, 2.0, lin_floor) == pytest.approx(1.0 + 1.0 * 0.5)
    assert lr_at(12, 12, 2.0, lin_floor) == pytest.approx(1.0)
    const = OptimizerConfig(warmup_steps=3, schedule="constant", min_lr_ratio=0.5)
    assert lr_at(0, 10, 3.0, const) == pytest.approx(1.0)
    assert [lr_at(s, 10, 3.0, const) for s in range(3, 11)] == pytest.approx([3.0] * 8)


def test_lr_warmup_longer_than_run():
    opt = OptimizerConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.0)
    assert lr_at(4, 5, 1.0, opt) == pytest.approx(0.5)
    assert lr_at(10, 5, 1.0, opt) == pytest.approx(1.0)  # no division by a non-positive span


def test_total_steps():
    assert total_steps(100, None, 1024, 32) == 100
    assert total_steps(None, 1.0, 1024, 32) == 32
    assert total_steps(None, 2.5, 100, 32) == 8  # ceil(250 / 32)
    assert total_steps(None, 0.001, 100, 32) == 1


def test_total_steps_refuses_a_batch_larger_than_the_dataset():
    # batch.global_batch=1000000000 once made take() build a billion-entry list at the first step.
    assert total_steps(10, None, 32, 32) == 10  # exactly the dataset: every sample once per step
    with pytest.raises(BatchPlanError, match=r"batch.global_batch: a step would take 33 samples, .*\(32\).* at most 32"):
        total_steps(10, None, 32, 33)
    with pytest.raises(BatchPlanError, match="batch.global_batch"):
        total_steps(None, 1.0, 1024, 10**9)


def test_total_steps_refuses_epochs_beyond_the_step_limit():
    assert total_steps(None, 1e6, 1000, 1000) == 10**6
    with pytest.raises(BatchPlanError, match=r"^epochs: .* more than the limit of 1000000000"):
        total_steps(None, 1e6, 10**6, 1)


# --------------------------------------------------------------------------- gradient invariant


def _model_and_batch(global_batch=16, vocab=11, dim=5, seq=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (global_batch, seq), generator=g)
    labels = ids.clone()
    lengths = torch.randint(2, seq + 1, (global_batch,), generator=g)  # variable lengths, padded
    for i, n in enumerate(lengths.tolist()):
        labels[i, n:] = -100
    labels[0, :3] = -100  # a prompt whose tokens are not targets
    return emb, w, ids, labels


def _token_ce_sum(w, emb, ids, labels):
    logits = emb[ids] @ w.T  # (b, s, vocab)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def _grad_as_trainer(w0, emb, ids, labels, world, micro_batch):
    """Per rank: sum of token CE over its micro-batches, times world/global_tokens,
    accumulated; then averaged over ranks as DDP's all-reduce does."""
    global_batch = ids.shape[0]
    plan = plan_batch(BatchConfig(global_batch=global_batch, micro_batch=micro_batch), 1.0, world)
    global_tokens = int((labels[:, 1:] != -100).sum())
    scale = world / global_tokens
    per_rank = deal(list(range(global_batch)), plan.per_rank)
    grads = []
    for rank, mine in enumerate(per_rank):
        w = w0.clone().requires_grad_(True)
        chunks = [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]
        assert len(chunks) == plan.micro_steps[rank]
        for chunk in chunks:
            (_token_ce_sum(w, emb, ids[chunk], labels[chunk]) * scale).backward()
        grads.append(w.grad)
    return torch.stack(grads).mean(0)


def test_gradient_independent_of_split():
    emb, w0, ids, labels = _model_and_batch()
    w = w0.clone().requires_grad_(True)
    F.cross_entropy((emb[ids] @ w.T)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100).backward()
    reference = w.grad  # token-mean CE over the whole global batch on one process
    assert reference.abs().sum() > 0
    for world in WORLDS:
        for micro_batch in (1, 2, 3, 5):
            got = _grad_as_trainer(w0, emb, ids, labels, world, micro_batch)
            torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-12,
                                       msg=f"world {world}, micro_batch {micro_batch}")


def test_mean_of_means_would_depend_on_split():
    """The control: a per-micro-batch mean loss (HF-style) does change with the
    split when lengths vary, so the test above is able to fail."""
    emb, w0, ids, labels = _model_and_batch()

    def mean_of_means(world, micro_batch):
        per_rank = deal(list(range(ids.shape[0])), split_evenly(ids.shape[0], world))
        grads = []
        for mine in per_rank:
            w = w0.clone().requires_grad_(True)
            chunks = [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]
            for chunk in chunks:
                n = int((labels[chunk][:, 1:] != -100).sum())
                (_token_ce_sum(w, emb, ids[chunk], labels[chunk]) / n / len(chunks)).backward()
            grads.append(w.grad)
        return torch.stack(grads).mean(0)

    assert not torch.allclose(mean_of_means(1, 16), mean_of_means(3, 2), rtol=1e-6)
