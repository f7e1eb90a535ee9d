"""The optimizer: AdamW with the fastest implementation the parameters' device has.

torch picks the per-parameter for-loop on CPU and ``foreach`` on CUDA by default. The fused kernel is
faster on both (measured on this project's CPU: 3-5x per step for LoRA-sized and 8B-LoRA-sized parameter
sets), and keeps its ``step`` counters on the parameters' device, so reading them costs no host sync.
"""

from __future__ import annotations

import torch

from elastic_ft.config import OptimizerConfig

FUSED_DEVICES = frozenset({"cpu", "cuda"})
"""Device types whose fused AdamW kernel torch 2.13 ships for floating-point parameters."""


def implementation(device_type: str, all_floating: bool) -> dict:
    """AdamW's keyword for the implementation to use: fused where the device has it, else torch's default."""
    if device_type in FUSED_DEVICES and all_floating:
        return {"fused": True}
    return {}


def build_adamw(params: list[torch.nn.Parameter], *, lr: float, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` (all on one device) with the spec's settings."""
    device_type = params[0].device.type if params else "cpu"
    impl = implementation(device_type, all(p.is_floating_point() for p in params))
    return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **impl)
