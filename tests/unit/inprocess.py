"""The real trainer in this process, one rank without a process group: for tests that compare whole runs."""

from __future__ import annotations

import dataclasses
import os

import torch

from elastic_ft.config import load_spec
from elastic_ft.runevents.events import read_events
from elastic_ft.train import loop
from elastic_ft.train.world import World
from tests.conftest import DEFAULT_SPEC

SHORT = ["steps=6", "batch.global_batch=8", "batch.micro_batch=4", "checkpoint.every_steps=3",
         "logging.every_steps=1", "optimizer.warmup_steps=0"]


@dataclasses.dataclass
class Run:
    trainer: loop.Trainer
    losses: list[float]
    """The step events' losses, in step order."""


def train(tmp_path, run_id: str, *overrides: str) -> Run:
    """A short run of the default spec with ``overrides``; the trainer is closed, its state still readable."""
    spec = load_spec(DEFAULT_SPEC, [*SHORT, *overrides])
    log_dir = os.path.join(tmp_path, run_id, "logs")
    opts = loop.RunOptions(run_id=run_id, checkpoint_uri=f"file://{tmp_path}", log_dir=log_dir)
    threads = torch.get_num_threads()
    trainer = loop.Trainer(spec, opts, World(0, 1, 0, 1, torch.device("cpu")))
    try:
        trainer.run()
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    events = read_events(os.path.join(log_dir, "events.jsonl"))
    return Run(trainer, [e["loss"] for e in events if e["event"] == "step"])
