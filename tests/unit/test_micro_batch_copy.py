"""Micro-batches reach a CUDA device from pinned host memory, copied asynchronously (``data.to_device``).

No GPU here: spies on ``Tensor.pin_memory`` and ``Tensor.to`` stand in for the device (as
test_collective_devices.py spies on the collectives), so what is checked is what the code asks for:
on a CUDA device every tensor of the micro-batch is pinned once and copied with ``non_blocking=True``
(from pageable memory each copy blocks the host, once per tensor and micro-batch); on the CPU nothing
is pinned (that needs an accelerator) or copied. And the trainer's step sends every micro-batch
through it. What it cannot show here: the overlap itself (scripts/gpu_smoke.sh runs the step on a GPU).
"""

from __future__ import annotations

import torch

from elastic_ft.train import data as data_mod
from tests.unit.inprocess import train


def micro_batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(12).reshape(2, 6)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def spy(monkeypatch) -> list[tuple]:
    """Record pin_memory and to() calls; a 'cuda' copy returns the tensor itself (there is no device)."""
    calls: list[tuple] = []
    real_to = torch.Tensor.to

    def pin_memory(self, *args, **kwargs):
        calls.append(("pin", id(self)))
        return self

    def to(self, *args, **kwargs):
        device = torch.device(args[0]) if args else kwargs.get("device")
        calls.append(("to", str(device), bool(kwargs.get("non_blocking", False))))
        return self if device is not None and device.type == "cuda" else real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_on_cuda_each_tensor_is_pinned_then_copied_without_blocking(monkeypatch):
    batch = micro_batch()
    calls = spy(monkeypatch)
    out = data_mod.to_device(batch, torch.device("cuda", 1))
    assert sorted(out) == sorted(batch)
    pins = [c for c in calls if c[0] == "pin"]
    copies = [c for c in calls if c[0] == "to"]
    assert sorted(p[1] for p in pins) == sorted(id(t) for t in batch.values())  # each tensor, once
    assert copies == [("to", "cuda:1", True)] * 3, copies
    assert [c[0] for c in calls] == ["pin", "to"] * 3  # pinned before its copy


def test_on_the_cpu_nothing_is_pinned_or_copied(monkeypatch):
    batch = micro_batch()
    calls = spy(monkeypatch)
    out = data_mod.to_device(batch, torch.device("cpu"))
    assert not [c for c in calls if c[0] == "pin"]
    assert all(out[k] is batch[k] for k in batch)  # .to() of a tensor already there is the tensor


def test_the_step_sends_every_micro_batch_through_it(monkeypatch, tmp_path):
    seen: list[tuple[int, str]] = []
    real = data_mod.to_device

    def to_device(batch, device):
        seen.append((batch["input_ids"].shape[0], str(device)))
        return real(batch, device)

    monkeypatch.setattr(data_mod, "to_device", to_device)
    train(tmp_path, "copies", "steps=2")  # 8 samples per step in micro-batches of 4, on one rank
    assert seen == [(4, "cpu")] * 4, seen
