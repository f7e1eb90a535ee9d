"""One rank of ``bench/checkpoint.py``'s part (d): the same state saved sharded (FSDP2 DTensors
through DCP) and replicated (each rank uploads its part of full tensors), then loaded at
another world size (sharded: resharded into this world's shards; replicated: every rank
loads it whole, as a replicated resume does).

    torchrun --nproc-per-node N bench/checkpoint_fsdp.py save|load URI MB REPEATS OUT SERVER_PID

save writes ``OUT/save.json`` (seconds per repeat of each path, the last manifests'
keys); load reads the manifests from it and writes ``OUT/load-N.json``. Every timing
starts and ends with a barrier (rank 0 times the slowest rank), the two paths
alternate which goes first, and the server is left to settle before each.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from elastic_ft.checkpoint.reader import load_blobs, read_manifest  # noqa: E402
from elastic_ft.checkpoint.sharded import load_sharded, save_sharded  # noqa: E402
from elastic_ft.checkpoint.store import open_store  # noqa: E402
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot, new_nonce  # noqa: E402


def full_state(total_mb: float) -> dict[str, dict[str, torch.Tensor]]:
    """The same tensors in every process (seeded): ~``total_mb`` of float32 matrices of 1024 columns."""
    g = torch.Generator().manual_seed(0)
    rows = 1024 + 7  # a multiple of neither 2 nor 3: the shards are uneven, as in a real model
    count = max(1, round(total_mb * 1e6 / (rows * 1024 * 4)))
    state: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}}
    for i in range(count):
        group = "model" if i % 3 else "optimizer"
        state[group][f"layers.{i}.weight"] = torch.randn(rows, 1024, generator=g)
    return state


def sharded(state: dict, mesh) -> dict:
    return {g: {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in named.items()} for g, named in state.items()}


def timed(fn, server_pid: int) -> float:
    if dist.get_rank() == 0:
        from checkpoint import settle  # bench/checkpoint.py

        settle(server_pid)
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def save(store, total_mb: float, repeats: int, out: str, server_pid: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    full = full_state(total_mb)
    shards = sharded(full, init_device_mesh("cpu", (world,)))
    writer = CheckpointWriter(store, "bench-fsdp")
    times: dict[str, list[float]] = {"replicated": [], "sharded": []}
    last: dict[str, str] = {}
    docs = {"trainer": {"step": 0}}

    def replicated(step: int, nonce: str) -> None:
        snap = Snapshot(step=step, cursor=0, tensors=full, documents=docs, config_hash="bench")
        refs = [None] * world
        dist.all_gather_object(refs, writer.upload_part(snap, nonce, part=rank, parts=world), group=group)
        if rank == 0:
            last["replicated"] = writer.commit_manifest(snap, {k: v for r in refs for k, v in r.items()}).key

    def sharded_save(step: int, nonce: str) -> None:
        snap = Snapshot(step=step, cursor=0, tensors={}, documents=docs, config_hash="bench", sharded=shards)
        blobs = save_sharded(writer, snap, nonce, group)
        if rank == 0:
            last["sharded"] = writer.commit_manifest(snap, blobs).key

    step = 0
    for r in range(repeats):
        for kind in (("replicated", "sharded") if r % 2 == 0 else ("sharded", "replicated")):
            step += 1
            box = [new_nonce()]
            dist.broadcast_object_list(box, src=0, group=group)  # one nonce on every rank, as the trainer agrees one
            fn = replicated if kind == "replicated" else sharded_save
            times[kind].append(timed(lambda: fn(step, box[0]), server_pid))
    if rank == 0:
        size = read_manifest(store, last["sharded"]).total_size
        with open(os.path.join(out, "save.json"), "w") as f:
            json.dump({"times": times, "manifests": last, "bytes": size, "world": world}, f)


def load(store, total_mb: float, repeats: int, out: str, server_pid: int) -> None:
    world = dist.get_world_size()
    with open(os.path.join(out, "save.json")) as f:
        keys = json.load(f)["manifests"]
    rep, shd = (read_manifest(store, keys[k]) for k in ("replicated", "sharded"))
    full = full_state(total_mb)
    target = sharded({g: {n: torch.zeros_like(t) for n, t in named.items()} for g, named in full.items()},
                     init_device_mesh("cpu", (world,)))
    times: dict[str, list[float]] = {"replicated": [], "sharded": []}
    for r in range(repeats):
        for kind in (("replicated", "sharded") if r % 2 == 0 else ("sharded", "replicated")):
            if kind == "replicated":
                times[kind].append(timed(lambda: load_blobs(store, rep), server_pid))
            else:
                times[kind].append(timed(lambda: load_sharded(store, shd, target), server_pid))
    ok = all(torch.equal(target[g][n].full_tensor(), t) for g, named in full.items() for n, t in named.items())
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"load-{world}.json"), "w") as f:
            json.dump({"times": times, "equal": ok, "world": world}, f)


def main(mode: str, uri: str, total_mb: str, repeats: str, out: str, server_pid: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for settle() of bench/checkpoint.py
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    store = open_store(uri)
    try:
        (save if mode == "save" else load)(store, float(total_mb), int(repeats), out, int(server_pid))
    finally:
        store.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
