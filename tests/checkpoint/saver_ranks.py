"""One rank of a 2-process gloo job that drives AsyncSaver through failures that
only one rank sees (``test_saver_ranks.py`` starts two of these).

``python saver_ranks.py RANK WORLD DIR``: joins the group through ``DIR/pg``,
saves into the LocalStore at ``DIR/store``, and writes what each scenario
raised on this rank to ``DIR/rank<RANK>.json``. A rank that decides other than
its peer would leave it in a collective: the closing all_reduce (30 s group
timeout) proves that none did.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.store import StoreUnavailable
from elastic_ft.checkpoint.writer import CheckpointWriter, new_nonce, snapshot
from elastic_ft.train.world import exit_process


class RankFaultyStore(LocalStore):
    """Blob puts raise StoreUnavailable while ``failing`` (set on one rank only)."""

    failing = False

    def put(self, key, data, *, if_absent=False):
        if self.failing and key.startswith("blobs/"):
            raise StoreUnavailable(f"{self.join(key)}: connection reset (this rank only)")
        super().put(key, data, if_absent=if_absent)


def snap(step: int, *, nan: bool = False):
    value = float("nan") if nan else float(step)
    tensors = {"model": {f"w{i}": torch.full((64,), value) for i in range(4)}}
    return snapshot(step, step, tensors, documents={"trainer": {"step": step}}, config_hash="cfg")


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def finish(results: dict, path: str) -> NoReturn:
    """Record that every rank got here (no collective left unpaired), write ``results``, leave the group,
    and end the process as a worker does (:func:`exit_process`: the interpreter's finalization would
    race gloo's threads, which outlive the group while a module or mesh still holds it, and abort)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    results["paired"] = int(t.item())
    with open(path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    exit_process(0)


def main(rank: int, world: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    results = {}

    def saver_on(run: str, store: LocalStore, **kw) -> AsyncSaver:
        return AsyncSaver(CheckpointWriter(store, run), rank=rank, world_size=world, group=group, part_attempts=1, **kw)

    # 1. The leader's manifest commit fails (another writer holds the step): every rank hears of it.
    store = LocalStore(os.path.join(root, "store", "conflict"))
    if rank == 0:
        CheckpointWriter(store, "conflict").commit(snap(1))
    dist.barrier()
    saver = saver_on("conflict", store)
    results["conflict"] = outcome(lambda: saver.save(snap(1), new_nonce()))
    saver.close()

    # 2. Only rank 1's uploads fail, twice in a row: both ranks stop at the next submit.
    store = RankFaultyStore(os.path.join(root, "store", "flaky"))
    store.failing = rank == 1
    saver = saver_on("flaky", store, max_failed_saves=2)
    for step in (1, 2):
        saver.submit(snap(step), new_nonce())
        saver.wait()
    results["flaky"] = outcome(lambda: saver.submit(snap(3), new_nonce()))
    saver.close()

    # 3. Only rank 1's state holds NaN: nothing is committed, and both ranks stop.
    saver = saver_on("nan", LocalStore(os.path.join(root, "store", "nan")))
    results["nan"] = outcome(lambda: saver.save(snap(1, nan=rank == 1), new_nonce()))
    results["nan_next"] = outcome(lambda: saver.submit(snap(2), new_nonce()))
    saver.close()

    # 4. Only rank 1's check of its shard raises (as a MemoryError would): it still
    # joins the gather, both ranks fail the save alike, and the next save commits.
    import elastic_ft.checkpoint.saver as saver_mod

    check = saver_mod.nonfinite_tensors

    def failing_check(tensors):
        raise MemoryError("no memory for the check (this rank only)")

    saver_mod.nonfinite_tensors = failing_check if rank == 1 else check
    store = LocalStore(os.path.join(root, "store", "check"))
    saver = saver_on("check", store)
    results["check"] = outcome(lambda: saver.save(snap(1), new_nonce()))
    saver_mod.nonfinite_tensors = check
    results["check_next"] = outcome(lambda: saver.save(snap(2), new_nonce()))
    saver.close()

    finish(results, os.path.join(root, f"rank{rank}.json"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
