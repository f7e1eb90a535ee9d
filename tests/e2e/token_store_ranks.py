"""Run under torchrun: every rank loads (so the world builds) the token stores named on the command line.

Arguments: the run store's directory, then one JSON DataConfig document per store. Prints each store's
identity on rank 0, with the restart it was loaded in. A rank whose load fails prints one line
``rank R error: ...`` and leaves as the worker does (every rank meets in a bounded settle first, so a
rank that learnt of the failure prints before torchrun stops the others), exit code 2.

``FAIL_PART_UPLOADS_ON_RANK=R``: on rank R, the run store refuses to write the build's parts, as a store
that is gone once its retries are spent. ``UNUSABLE_NODE_CACHE_ON_RANK=R``: on rank R, the node cache is
a path under a regular file, so nothing can be written there (even by root).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

from elastic_ft.checkpoint.errors import StoreUnavailable
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.config import DataConfig
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.world import close_world, exit_process, init_world, settle


class RefusesParts(LocalStore):
    def put(self, key, data, *, if_absent=False):
        if "/parts/" in key:
            raise StoreUnavailable(f"injected: the store refuses {key}")
        return super().put(key, data, if_absent=if_absent)


def main() -> None:
    world = init_world(timedelta(seconds=120))
    fail_rank = os.environ.get("FAIL_PART_UPLOADS_ON_RANK")
    store_type = RefusesParts if fail_rank is not None and int(fail_rank) == world.rank else LocalStore
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    unusable = os.environ.get("UNUSABLE_NODE_CACHE_ON_RANK")
    if unusable is not None and int(unusable) == world.rank:
        blocker = os.path.join(os.environ["ELASTIC_FT_INPUT_CACHE"] + f"-rank{world.rank}-is-a-file")
        with open(blocker, "w") as f:
            f.write("not a directory\n")
        os.environ["ELASTIC_FT_INPUT_CACHE"] = os.path.join(blocker, "cache")
    try:
        for doc in sys.argv[2:]:
            store, built = data_mod.load_with_report(DataConfig(**json.loads(doc)), byte_tokenizer(), world=world,
                                                     store=store_type(sys.argv[1]), run_id="r")
            if world.is_leader:
                say(f"identity {built.identity} built {built.built} samples {len(store)} restart {restart}")
    except Exception as exc:  # noqa: BLE001 - the worker's way out: one line, then leave together
        say(f"rank {world.rank} error: {type(exc).__name__}: {exc}")
        settle(world, timedelta(seconds=20))
        exit_process(2)
    close_world(world)


def say(line: str) -> None:
    # One write per line: both ranks share torchrun's stdout pipe, and print() writes the text and its newline
    # separately, so two ranks failing together interleaved their lines (CI saw "...tokens'rank 0 error: ...").
    # A write under PIPE_BUF bytes to a pipe is atomic.
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
