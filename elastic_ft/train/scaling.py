"""Batch and learning-rate policy for the world at hand (pure functions).

``constant_global`` (default): the global batch is fixed; each rank's share
and its micro-batch count are recomputed for the current world (uneven splits
allowed), and the loss is normalised by the global target-token count, so the
gradient does not depend on the split and the LR stays as stated. A world
larger than the global batch (a node joined) is no error: the ranks beyond it
get no sample (``idle_ranks``) and sit each step out at zero weight, since
ending the run because capacity arrived would be the wrong way round.

``scale_with_world``: the per-rank batch is fixed at
``global_batch / reference_world``; the global batch follows the world, and
the LR is rescaled against the reference world by the ``linear`` rule
(``lr * w / ref``) or the ``sqrt`` rule (``lr * sqrt(w / ref)``).
"""

from __future__ import annotations

import dataclasses
import math

from elastic_ft.config import MAX_STEPS, BatchConfig, OptimizerConfig


class BatchPlanError(ValueError):
    """The batch settings cannot be met by the current world."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    world: int
    global_batch: int
    per_rank: tuple[int, ...]
    """Samples each rank processes per step (sums to ``global_batch``)."""
    micro_batch: int
    micro_steps: tuple[int, ...]
    """Forward/backward passes each rank makes per step (gradient accumulation)."""
    lr: float
    """Peak LR for this world."""
    policy: str
    reason: str
    lr_factor: float = 1.0
    """The multiplier the policy applied to the spec's LR for this world (1.0 under ``constant_global``)."""
    idle_ranks: int = 0
    """Ranks given no sample each step (the last ones): ``constant_global`` over a world larger than its
    global batch. They run the step's collectives with zero-weight work (see ``sharding.lockstep``)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` integers differing by at most one, larger first."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def plan_batch(batch: BatchConfig, lr: float, world: int) -> BatchPlan:
    """The batch plan for ``world`` ranks; raises :class:`BatchPlanError` naming the field."""
    if world < 1:
        raise BatchPlanError(f"world size must be at least 1, got {world}")
    if batch.policy == "constant_global":
        global_batch, factor = batch.global_batch, 1.0
        reason = f"constant_global: {global_batch} samples per step over {world} rank(s), lr unchanged"
        if global_batch < world:
            reason += f"; {idle_note(world - global_batch, world, global_batch)}"
    elif batch.policy == "scale_with_world":
        per_rank = batch.global_batch // batch.reference_world
        global_batch = per_rank * world
        ratio = world / batch.reference_world
        factor = ratio if batch.lr_scaling == "linear" else math.sqrt(ratio)
        reason = (
            f"scale_with_world: {per_rank} samples per rank x {world} rank(s); "
            f"lr x{factor:.4g} ({batch.lr_scaling} rule, reference world {batch.reference_world})"
        )
    else:  # pragma: no cover - config validation rejects other values
        raise BatchPlanError(f"batch.policy {batch.policy!r} is not supported")
    per = split_evenly(global_batch, world)
    micro = tuple(math.ceil(n / batch.micro_batch) for n in per)
    return BatchPlan(world, global_batch, per, batch.micro_batch, micro, lr * factor, batch.policy, reason, factor,
                     idle_ranks=per.count(0))


def idle_note(idle: int, world: int, global_batch: int) -> str:
    """Why ``idle`` of ``world`` ranks take no sample: one line, for the log and the plan's reason."""
    return (f"{idle} of {world} rank(s) idle each step: batch.global_batch ({global_batch}) is smaller than the "
            f"world, and constant_global keeps the global batch, so ranks {global_batch}..{world - 1} sit each "
            f"step out (zero-weight work in its collectives) until the world shrinks or batch.global_batch is "
            f"raised to at least {world}")


_PLAN_FIELDS = ("world", "global_batch", "per_rank", "micro_batch", "micro_steps", "lr", "lr_factor", "policy",
                "idle_ranks")
"""What a ``rescale`` event states of each side (old: the plan the checkpoint was trained with)."""


def rescale_event(old: dict | None, new: BatchPlan) -> dict | None:
    """The ``rescale`` event fields when the plan changed since ``old`` (a saved plan), else None.

    The event states both plans in full (``old``, ``new``: world, global
    batch, per-rank samples, micro-batch, accumulation steps, peak LR and the
    policy's LR multiplier, the ranks that sit each step out) and which of
    them ``changed``; ``idle_ranks`` also stands on its own (the new plan's).
    A plan saved before ``lr_factor`` or ``idle_ranks`` was recorded reports
    it as None. Only a change of world, batch or LR counts; the multiplier and
    the idle ranks follow from those.
    """
    if old is None:
        return None
    keys = ("world", "global_batch", "per_rank", "micro_steps", "lr")
    new_d = new.to_dict()
    changed = {k: {"old": old.get(k), "new": new_d[k]} for k in keys
               if _norm(old.get(k)) != _norm(new_d[k])}
    if not changed:
        return None
    return {"policy": new.policy, "reason": new.reason, "idle_ranks": new.idle_ranks,
            "old": {k: old.get(k) for k in _PLAN_FIELDS}, "new": {k: new_d[k] for k in _PLAN_FIELDS},
            "changed": changed}


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def lr_at(step: int, total_steps: int, peak: float, opt: OptimizerConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warm-up, then the decay schedule."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return peak * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return peak
    span = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, max(0.0, (step - opt.warmup_steps) / span))
    floor = peak * opt.min_lr_ratio
    if opt.schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def total_steps(steps: int | None, epochs: float | None, dataset_size: int, global_batch: int) -> int:
    """Steps of the run: ``steps`` as given, or enough global batches to cover ``epochs``.

    Raises :class:`BatchPlanError` naming the field when a step would take
    more samples than the dataset holds (each would repeat within the step,
    and a huge batch would be built in memory), or when ``epochs`` makes more
    than ``config.MAX_STEPS`` steps. Callers check this before the first step.
    """
    if global_batch > dataset_size:
        raise BatchPlanError(
            f"batch.global_batch: a step would take {global_batch} samples, more than the dataset holds "
            f"({dataset_size}); lower batch.global_batch to at most {dataset_size} or add data"
        )
    if steps is not None:
        return steps
    assert epochs is not None
    count = max(1, math.ceil(epochs * dataset_size / global_batch))
    if count > MAX_STEPS:
        raise BatchPlanError(
            f"epochs: {epochs} epochs of {dataset_size} samples in batches of {global_batch} make {count} steps, "
            f"more than the limit of {MAX_STEPS}"
        )
    return count
