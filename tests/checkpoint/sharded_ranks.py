"""One rank of a torchrun job that saves or loads a sharded (FSDP2) checkpoint; test_sharded_store.py runs it.

``torchrun --nproc-per-node N sharded_ranks.py save|load STORE_URI OUT [CORRUPT_URI]``

save: a small model under ``fully_shard`` over ``init_device_mesh("cpu", (N,))``
takes an AdamW step; its state (model and optimizer, DTensors, the contract's
layout) is staged and saved through the AsyncSaver's sharded path while the
model trains on (the snapshot is a copy). Rank 0 writes ``OUT/expected.safetensors``,
the values gathered with ``full_tensor()`` from the snapshot. Then two saves
that must fail on every rank alike and leave no manifest: rank 1's blob puts
fail (step 2), rank 1's shard holds a NaN (step 3).

load: a fresh model at world N; the newest checkpoint is loaded into its
shards and into zeroed optimizer shards, with ``pickle.loads``/``torch.load``
made to raise; rank 0 writes ``OUT/loaded-N.safetensors`` (the gathered
values). With CORRUPT_URI, the load from that store must fail on every rank.

Each rank writes what it saw to ``OUT/<mode>-<N>-rank<R>.json``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elastic_ft.checkpoint.reader import list_manifests, read_manifest
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.sharded import load_sharded, stage
from elastic_ft.checkpoint.store import ObjectStore, StoreUnavailable, open_store
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot
from saver_ranks import finish, outcome  # a sibling script (this one runs as a script too)


class FaultyStore(ObjectStore):
    """Delegates to ``inner``; blob puts raise StoreUnavailable while ``failing`` (set on one rank only)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.uri, self.failing, self.failed_puts = inner, inner.uri, False, 0

    def put(self, key, data, *, if_absent=False):
        if self.failing and key.startswith("blobs/"):
            self.failed_puts += 1
            raise StoreUnavailable(f"{self.join(key)}: connection reset (this rank only)")
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key):
        return self.inner.get(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)


def build(world: int) -> nn.Module:
    torch.manual_seed(0)
    # 16 and 5 rows: sharded unevenly at 3 ranks (and 5 over 2), so resharding moves partial rows.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed * 10 + rank))
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full(state: dict) -> dict[str, torch.Tensor]:
    """Every leaf whole (``full_tensor()``: collective, same order on every rank), as ``group/name``."""
    return {f"{g}/{n}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for g, named in sorted(state.items()) for n, v in sorted(named.items())}


def save(rank: int, world: int, uri: str, out: str) -> dict:
    model = build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step(model, opt, rank, 1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": {f"{fqn}::{k}": v for fqn, st in osd["state"].items() for k, v in st.items()}}
    staged = stage(state)
    expected = full(staged)
    if rank == 0:
        save_file(expected, os.path.join(out, "expected.safetensors"))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    store = FaultyStore(open_store(uri))
    docs = {"trainer": {"step": 1, "param_groups": osd["param_groups"]}}

    def snap(step: int, sharded: dict) -> Snapshot:
        return Snapshot(step=step, cursor=8 * step, tensors={}, documents=docs, config_hash="cfg",
                        world={"size": world}, sharded=sharded)

    results = {}
    commits = []
    saver = AsyncSaver(CheckpointWriter(store, "sharded"), rank=rank, world_size=world, group=group,
                       part_attempts=2, on_commit=lambda m, s: commits.append(sorted(m.blobs)))
    saver.submit(snap(1, staged), "n1")  # one nonce on every rank, as the trainer agrees one
    train_step(model, opt, rank, 2)  # training goes on while the snapshot uploads
    results["commit"] = outcome(saver.flush)
    results["commit_blobs"] = commits[0] if commits else None
    store.failing = rank == 1
    results["failing_put"] = outcome(lambda: saver.save(snap(2, staged), "n2"))
    results["failed_puts"] = store.failed_puts
    store.failing = False
    nan = stage(state)
    if rank == 1:
        nan["model"]["0.weight"].to_local()[0, 0] = float("nan")
    results["nan"] = outcome(lambda: saver.save(snap(3, nan), "n3"))
    saver.close()
    return results


def forbid_unpickling():
    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled while loading a sharded checkpoint")

    pickle.loads = pickle.load = torch.load = refuse


def load(rank: int, world: int, uri: str, out: str, corrupt: str | None) -> dict:
    model = build(world)
    msd = dict(model.state_dict())  # DTensors sharing the parameters' memory: loaded in place
    state = {"model": msd, "optimizer": {}}
    for fqn, p in msd.items():
        state["optimizer"][f"{fqn}::exp_avg"] = torch.zeros_like(p)
        state["optimizer"][f"{fqn}::exp_avg_sq"] = torch.zeros_like(p)
        state["optimizer"][f"{fqn}::step"] = torch.zeros(())
    forbid_unpickling()
    store = open_store(uri)
    manifests = list_manifests(store)
    manifest = read_manifest(store, manifests[-1].key)
    results = {"steps": [m.key for m in manifests]}
    results["load"] = outcome(lambda: load_sharded(store, manifest, state))
    loaded = full(state)
    if rank == 0:
        save_file(loaded, os.path.join(out, f"loaded-{world}.safetensors"))
    results["params_are_loaded"] = bool(torch.equal(model[0].weight.full_tensor(), loaded["model/0.weight"]))
    if corrupt is not None:
        bad = open_store(corrupt)
        results["corrupt"] = outcome(lambda: load_sharded(bad, read_manifest(bad, manifests[-1].key), state))
    return results


def main(mode: str, uri: str, out: str, corrupt: str | None = None) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = save(rank, world, uri, out) if mode == "save" else load(rank, world, uri, out, corrupt)
    finish(results, os.path.join(out, f"{mode}-{world}-rank{rank}.json"))


if __name__ == "__main__":
    main(*sys.argv[1:])
