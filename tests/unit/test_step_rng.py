"""The per-step reseeding (elastic_ft.train.rng): torch.manual_seed's streams, without its per-call cost."""

from __future__ import annotations

import os
import traceback

import torch

from elastic_ft.config import load_spec
from elastic_ft.train import loop
from elastic_ft.train.rng import reseed
from elastic_ft.train.world import World
from tests.conftest import DEFAULT_SPEC


def _draws() -> list[torch.Tensor]:
    """What a step draws: uniform numbers and a dropout mask (bernoulli), from the default CPU generator."""
    return [torch.rand(16), torch.nn.functional.dropout(torch.ones(64), p=0.3)]


def test_reseed_gives_the_cpu_streams_of_manual_seed():
    for seed in (0, 1234 * 1_000_003 + 5 * 7_919 + 1, 2**62 + 17):
        torch.manual_seed(seed)
        expected = _draws()
        torch.rand(3)  # move the stream on: reseed must restart it, not continue it
        reseed(seed, torch.device("cpu"))
        for got, want in zip(_draws(), expected):
            assert torch.equal(got, want)


def test_a_training_step_records_no_tracebacks(tmp_path, monkeypatch):
    """torch.manual_seed formats a stack trace per backend not initialised here (CUDA, XPU, MTIA on this
    host), ~0.5 ms a step in the trainer's deep stack: the step's reseeding must not go through it."""
    spec = load_spec(DEFAULT_SPEC, ["steps=3", "batch.global_batch=8", "batch.micro_batch=4", "lora.dropout=0.1"])
    opts = loop.RunOptions(run_id="rng", checkpoint_uri=f"file://{tmp_path}", log_dir=os.path.join(tmp_path, "logs"))
    threads = torch.get_num_threads()
    trainer = loop.Trainer(spec, opts, World(0, 1, 0, 1, torch.device("cpu")))
    stacks: list[int] = []
    real = traceback.format_stack

    def counted(*args, **kwargs):
        stacks.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(traceback, "format_stack", counted)
    try:
        first = trainer.step_once()
        trainer.step_once()
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    assert stacks == []
    assert torch.isfinite(first.loss_sum)
