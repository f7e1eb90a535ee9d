"""Training data: the spec's samples as a token store, tokenized once per run and memory-mapped.

:func:`load` returns the run's :class:`~elastic_ft.train.token_store.TokenStore`
for the spec's data and tokenizer: built by the ranks of the first world
together and committed to the run's checkpoint location, then mapped from each
node's disk by every rank at every start (:mod:`elastic_ft.train.token_build`).
Every rank can still take any sample the cursor deals it: there are no shards
to reassign when the world changes. Each sample's count of target tokens is
kept, so the loss can be normalised by the exact global token count of a step.

Cost of a start once the store is committed and on the node: a manifest read
and a few stats, nothing that grows with the dataset.
"""

from __future__ import annotations

import torch

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.config import DataConfig
from elastic_ft.inputs.resolve import InputSource, default_source
from elastic_ft.train.datafiles import DataError
from elastic_ft.train.token_build import Built, ensure
from elastic_ft.train.token_store import IGNORE, TokenStore
from elastic_ft.train.world import World

STANDALONE_RUN = "standalone"
"""The run id of a store built outside a run (tools, tests): kept under the node cache's ``tokens/standalone``."""


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch's host tensors on ``device``, without a host sync on CUDA.

    On CUDA each tensor is first copied into page-locked (pinned) host memory, then
    to the device with ``non_blocking=True``: from pageable memory the copy is
    staged by the driver and blocks the host until it is done, once per tensor and
    micro-batch. The pinned block goes back to torch's caching host allocator
    only once the copy that reads it has completed (it records the stream), so
    nothing here waits. Pinning needs an accelerator and buys nothing without one:
    elsewhere the tensors are moved as they are (on the CPU, not copied at all).
    Cost: one host copy of the micro-batch (its ids, labels and mask) per micro-batch.
    """
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def load(cfg: DataConfig, tokenizer, inputs: InputSource | None = None, *, world: World | None = None,
         store: ObjectStore | None = None, run_id: str = STANDALONE_RUN) -> TokenStore:
    """The token store of ``cfg`` and ``tokenizer``: the run's (``store``, ``run_id``; built by ``world`` when it
    is not committed yet), mapped from this node's cache. ``s3://`` files are read from this node's cached
    copies, fetched through ``inputs`` (default: the environment's cache and S3 settings). Without ``store``,
    a store of its own under the node cache (tools and tests)."""
    return load_with_report(cfg, tokenizer, inputs, world=world, store=store, run_id=run_id)[0]


def load_with_report(cfg: DataConfig, tokenizer, inputs: InputSource | None = None, *, world: World | None = None,
                     store: ObjectStore | None = None, run_id: str = STANDALONE_RUN) -> tuple[TokenStore, Built]:
    """:func:`load`, and whether this start built the store, and how long it took."""
    if inputs is None:
        with default_source() as own:
            return load_with_report(cfg, tokenizer, own, world=world, store=store, run_id=run_id)
    if world is None:
        world = World(0, 1, 0, 1, torch.device("cpu"))
    if store is None:
        import os

        store = LocalStore(os.path.join(inputs.root, "tokens", STANDALONE_RUN))
    return ensure(world, store, run_id, inputs.data(cfg), tokenizer, inputs.root)


__all__ = ["DataError", "IGNORE", "TokenStore", "load", "load_with_report", "to_device"]
