"""Every tensor the trainer hands to a collective of the default group is on the world's device.

On a GPU host the default group is NCCL, and NCCL refuses host tensors (and the
object collectives need a CUDA device to stage their bytes). No GPU is here, so
a spy wraps torch.distributed's collectives around the trainer's real run: one
rank on a real gloo group, in this process, through resume, steps, metrics
flushes, the preemption agreement and checkpoint saves, and checks each call
against the rule. What it proves on a CPU host: the rule holds wherever the
code names a device, and every collective path of a run was exercised (the
test fails if one was not seen); the spy's own checks are shown to fire by
``test_the_spy_catches_a_host_tensor_on_a_device_world``. What it cannot prove
here: that host and device differ (both are the CPU), i.e. the run on NCCL
itself. The fix it guards: loss sums live on ``World.device`` (no host sync per
micro-batch), object broadcasts name the device.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from elastic_ft.config import load_spec
from elastic_ft.train import loop, world as world_mod
from tests.conftest import DEFAULT_SPEC

TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
                      "reduce_scatter_tensor")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


@dataclasses.dataclass
class Spy:
    """Wraps torch.distributed's collectives; records what the rule says of each call on the default group."""

    expected: torch.device | None = None
    calls: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)

    def install(self, monkeypatch) -> None:
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, real):
        def spied(*args, **kwargs):
            group = kwargs.get("group")
            if group is None or group is dist.group.WORLD:  # the saver's own gloo group takes host tensors
                self.check(name, args, kwargs)
            return real(*args, **kwargs)
        return spied

    def check(self, name: str, args, kwargs) -> None:
        assert self.expected is not None, "a collective ran before the world was made"
        if name in TENSOR_COLLECTIVES:
            for t in [a for a in args if torch.is_tensor(a)]:
                self.calls.append((name, str(t.dtype)))
                if t.device != self.expected:
                    self.violations.append(f"{name} got a {t.dtype} on {t.device}, the group serves {self.expected}")
        else:
            self.calls.append((name, ""))
            # broadcast_object_list stages its bytes on `device`; without it NCCL relies on set_device.
            if name == "broadcast_object_list" and kwargs.get("device") != self.expected:
                self.violations.append(f"{name} without device={self.expected} (got {kwargs.get('device')})")


def test_the_trainers_collectives_take_tensors_on_the_world_device(monkeypatch, tmp_path, one_rank_gloo):
    spy = Spy()
    real_init = loop.init_world

    def init_world(*args, **kwargs):
        world = real_init(*args, **kwargs)
        spy.expected = world.device
        return world

    monkeypatch.setattr(loop, "init_world", init_world)
    spy.install(monkeypatch)
    spec = load_spec(DEFAULT_SPEC, ["steps=4", "batch.global_batch=8", "batch.micro_batch=4",
                                    "checkpoint.every_steps=2", "logging.every_steps=2", "logging.ledger=true"])
    opts = loop.RunOptions(run_id="spy", checkpoint_uri=f"file://{tmp_path}", log_dir=str(tmp_path / "logs"))
    summary = loop.run(spec, opts)
    assert summary["step"] == 4
    assert not spy.violations, spy.violations
    seen = set(spy.calls)
    # The metrics' loss sums, the preemption agreement, and the leader's decisions: each path was exercised.
    assert {("all_reduce", "torch.float64"), ("all_reduce", "torch.int64"), ("broadcast_object_list", ""),
            ("all_gather_object", "")} <= seen, seen


def test_the_spy_catches_a_host_tensor_on_a_device_world(monkeypatch, one_rank_gloo):
    """The rule fires for the failure NCCL would have: a host tensor on a group that serves another device."""
    dist.init_process_group("gloo")
    try:
        spy = Spy(expected=torch.device("meta"))
        spy.install(monkeypatch)
        dist.all_reduce(torch.zeros(2))
        dist.broadcast_object_list([1], src=0)
        assert len(spy.violations) == 2, spy.violations
    finally:
        dist.destroy_process_group()


def test_loss_sums_are_reduced_where_they_are(monkeypatch, one_rank_gloo):
    """A sum already on the world's device is reduced in place, with no copy through the host."""
    world = world_mod.init_world()
    try:
        t = torch.tensor([1.5, 2.5], dtype=torch.float64)
        moved = []
        real_to = torch.Tensor.to
        monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moved.append(a) or real_to(self, *a, **k))
        world_mod.sum_over_ranks(world, t)
        assert t.tolist() == [1.5, 2.5] and moved == []
    finally:
        world_mod.close_world(world)
