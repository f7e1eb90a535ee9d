"""AdamW: the fused kernel where the device has it, and its state restored by name through torch's load_state_dict."""

from __future__ import annotations

import pytest
import torch

from elastic_ft.config import OptimizerConfig
from elastic_ft.train.optim import build_adamw, implementation
from elastic_ft.train.restore import load_optimizer_tensors, optimizer_tensors
from tests.unit.inprocess import train


def test_fused_where_the_device_has_it():
    assert implementation("cpu", True) == {"fused": True}
    assert implementation("cuda", True) == {"fused": True}
    assert implementation("mps", True) == {}  # torch's default there
    assert implementation("cuda", False) == {}
    opt = build_adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, cfg=OptimizerConfig())
    assert opt.param_groups[0]["fused"] is True


def _stepped(device: str, **kw) -> tuple[torch.optim.AdamW, dict]:
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.AdamW([p], lr=1e-2, **kw)
    return opt, {"w": p}


def test_a_restored_step_stays_on_the_host_unless_the_optimizer_is_fused():
    """torch's rule, which a GPU run needs: a plain AdamW reads ``step.item()`` per parameter, so a ``step``
    on the device would cost a host sync per parameter per step. ``meta`` stands in for a GPU here."""
    src, params = _stepped("cpu", fused=True)
    params["w"].grad = torch.ones(3)
    src.step()
    saved = optimizer_tensors(src, {p: n for n, p in params.items()})
    saved["w::exp_avg"] = saved["w::exp_avg"].double()  # a state saved in another dtype takes the parameter's

    plain, on_device = _stepped("meta")
    load_optimizer_tensors(plain, on_device, saved)
    state = plain.state[on_device["w"]]
    assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32
    assert state["exp_avg"].device.type == "meta" and state["exp_avg"].dtype == torch.float32

    fused, own = _stepped("cpu", fused=True)
    load_optimizer_tensors(fused, own, saved)
    assert float(fused.state[own["w"]]["step"]) == 1.0


@pytest.mark.slow  # trains in this process: over 10 s on 2 cores
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path):
    # A constant LR: the schedule's length (the run's steps) must not differ between the two.
    whole = train(tmp_path, "whole", "optimizer.schedule=constant")
    train(tmp_path, "cut", "optimizer.schedule=constant", "steps=3")
    resumed = train(tmp_path, "cut", "optimizer.schedule=constant")  # from step 3, optimizer state included
    assert resumed.trainer.optimizer.param_groups[0]["fused"] is True
    steps = {float(s["step"]) for s in resumed.trainer.optimizer.state.values()}
    assert steps == {6.0}
    for name, a in whole.trainer.trainable.items():
        torch.testing.assert_close(resumed.trainer.trainable[name], a, rtol=1e-6, atol=1e-8, msg=name)
