"""One rank of a 2-process gloo job whose peer is lost during a background save (``test_saver_ranks.py``
starts two of these).

``python abandon_ranks.py RANK DIR MODE``: joins the group through ``DIR/pg`` and saves into the
LocalStore at ``DIR/store`` with ``save_timeout_s`` 600 (the background group's timeout too), then:

- ``killed``: rank 1 SIGKILLs itself once the save is submitted, while rank 0's part is failing
  and retrying (every blob put of rank 0 raises StoreUnavailable, 50 attempts with backoff);
- ``stopped``: rank 1 SIGSTOPs itself (a node gone without a TCP reset), so rank 0's part uploads
  and its saver thread waits in the gather for rank 1's part, which never comes.

Rank 1 is lost while its own part uploads (its puts take 2 s), so its part never reaches the gather.

Rank 0 finds the peer gone as a trainer does (its next collective fails, here one with a 5 s
timeout), closes its saver on that error path (``abandon``) and leaves the process group, timing
each, and writes ``DIR/rank0.json``. Its thread is then left as it is (a daemon) for the exit.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.store import StoreUnavailable
from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot
from elastic_ft.train.world import exit_process

SAVE_TIMEOUT_S = 600.0


class OutageStore(LocalStore):
    """Blob puts raise StoreUnavailable while ``failing``, and take ``put_s`` seconds."""

    failing = False
    put_s = 0.0
    attempts = 0

    def put(self, key, data, *, if_absent=False):
        if key.startswith("blobs/"):
            time.sleep(self.put_s)
            if self.failing:
                self.attempts += 1
                raise StoreUnavailable(f"{self.join(key)}: 503 Slow Down (outage)")
        super().put(key, data, if_absent=if_absent)


def main(rank: int, root: str, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    timeout = datetime.timedelta(seconds=SAVE_TIMEOUT_S)
    ckpt_group = dist.new_group(backend="gloo", timeout=timeout)  # as the trainer makes it
    probe = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    store = OutageStore(os.path.join(root, "store"))
    store.failing = mode == "killed" and rank == 0
    store.put_s = 2.0 if rank == 1 else 0.0  # rank 1 is lost while its part uploads: its part never comes
    saver = AsyncSaver(CheckpointWriter(store, "run"), rank=rank, world_size=2, group=ckpt_group,
                       part_attempts=50, timeout_s=SAVE_TIMEOUT_S)
    tensors = {"model": {f"w{i}": torch.full((64,), float(i)) for i in range(4)}}
    dist.barrier()
    saver.submit(snapshot(1, 8, tensors, documents={"trainer": {"step": 1}}, config_hash="cfg"), "n1")
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL if mode == "killed" else signal.SIGSTOP)
    try:
        dist.all_reduce(torch.ones(1), group=probe)  # the trainer's next collective
        error = None
    except RuntimeError as exc:
        error = str(exc).splitlines()[0][:200]
    t0 = time.monotonic()
    stopped = saver.close(abandon=True)  # the error path's close
    close_s = time.monotonic() - t0
    dist.destroy_process_group()
    result = {"error": error, "close_s": close_s, "thread_stopped": stopped,
              "destroy_s": time.monotonic() - t0 - close_s, "failed_puts": store.attempts,
              "saver_threads": [t.name for t in threading.enumerate() if t.name == "ckpt-saver"]}
    with open(os.path.join(root, "rank0.json"), "w") as f:
        json.dump(result, f)
    exit_process(0)  # as a worker ends: never through the interpreter's finalization


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
