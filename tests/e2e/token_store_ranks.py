"""Run under torchrun: every rank loads (so the world builds) the token stores named on the command line.

Arguments: the run store's directory, then one JSON DataConfig document per store. Prints each store's
identity on rank 0.
"""

from __future__ import annotations

import json
import sys

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.config import DataConfig
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.world import close_world, init_world


def main() -> None:
    world = init_world()
    try:
        for doc in sys.argv[2:]:
            store, built = data_mod.load_with_report(DataConfig(**json.loads(doc)), byte_tokenizer(), world=world,
                                                     store=LocalStore(sys.argv[1]), run_id="r")
            if world.is_leader:
                print(f"identity {built.identity} built {built.built} samples {len(store)}", flush=True)
    finally:
        close_world(world)


if __name__ == "__main__":
    main()
