"""How a rank's share of a step is cut into micro-batches, and the tokens a step computes.

A rank groups its dealt items by length before cutting them (each micro-batch pads to its own longest
item), and the step's real and computed token counts follow from the global deal alone, so every rank
knows them without a collective. Cost per step: a sort of the rank's share (grows with the batch only).
"""

from __future__ import annotations

import numpy as np

from elastic_ft.train.cursor import deal


def micro_batches(items: list[int], size: int, lengths=None) -> list[list[int]]:
    """A rank's items cut into micro-batches of at most ``size``: in order, or with ``lengths`` (tokens per
    item) longest first, so that each micro-batch holds items of like length and pads little.

    Grouping changes only which of a rank's items share a micro-batch: the loss is a sum over tokens
    normalised by the step's global token count, so the step's gradient is the same up to float order,
    and the ledger still records the items dealt. Ties keep the dealt order (stable sort): deterministic.
    """
    if lengths is not None and len(items) > size:
        order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
        items = [items[k] for k in order.tolist()]
    return [items[i : i + size] for i in range(0, len(items), size)]


def step_tokens(data, indices: list[int], plan, *, flat: bool = False) -> dict[str, int]:
    """A step's real tokens (its samples', no padding) and the token positions all ranks' micro-batches
    compute, padding included, grouped and laid out as :meth:`elastic_ft.train.loop.Trainer.train_step` does (lockstep's
    zero-weight repeats not counted): the deal is global, so every rank knows them without a collective."""
    chunks = [c for d in deal(indices, plan.per_rank)
              for c in micro_batches(d, plan.micro_batch, data.micro_lengths(d))]
    return {"real_tokens": data.real_tokens(indices), "computed_tokens": data.computed_tokens(chunks, flat=flat)}


__all__ = ["micro_batches", "step_tokens"]
