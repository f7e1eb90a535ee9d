"""Mixed precision: frozen weights in a low dtype, trainable weights and their optimizer state in float32,
the matmuls under ``torch.autocast``.

The policy is FSDP's ``MixedPrecisionPolicy`` and ``accelerate``'s ``mixed_precision="bf16"`` read for
LoRA: what is not trained is stored low (it is most of the memory), what is trained keeps float32 so that
small updates are not rounded away, and autocast picks the compute dtype per op. The default (everything
float32, no autocast) changes nothing, and leaves a legacy ``model.dtype`` cast alone.
"""

from __future__ import annotations

import contextlib

import torch

from elastic_ft.config import ConfigError, PrecisionConfig


def is_default(cfg: PrecisionConfig) -> bool:
    return cfg == PrecisionConfig()


def device_problems(cfg: PrecisionConfig, device_type: str, bf16_supported: bool) -> list[tuple[str, str]]:
    """Why ``cfg`` cannot run on a device of ``device_type`` (one (field, message) per field), or nothing."""
    out = []
    for field in ("param_dtype", "compute"):
        if getattr(cfg, field) == "bfloat16" and not bf16_supported:
            out.append((f"precision.{field}", f"bfloat16 is not supported by this {device_type} device; use "
                                              f"float32 (or float16 for precision.param_dtype)"))
    return out


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (pre-Ampere GPUs emulate it, slowly, or not at all)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True  # CPU kernels and autocast take bfloat16 on every CPU torch supports


def check_device(cfg: PrecisionConfig, device: torch.device) -> None:
    """Raise :class:`ConfigError` naming the field when ``device`` cannot run ``cfg``."""
    problems = device_problems(cfg, device.type, bf16_supported(device))
    if problems:
        raise ConfigError(problems)


def apply(model: torch.nn.Module, cfg: PrecisionConfig) -> None:
    """Frozen floating-point weights to ``cfg.param_dtype``, trainable ones to float32 (in place).

    Buffers (rotary frequencies, masks) keep their dtype: they are small and some are precision-critical.
    """
    if is_default(cfg):
        return
    low = getattr(torch, cfg.param_dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if p.requires_grad else low)


def autocast(cfg: PrecisionConfig, device: torch.device):
    """The context the forward pass runs in: autocast to ``cfg.compute``, or nothing for float32."""
    if cfg.compute == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, cfg.compute))


def load_dtype(spec_model_dtype: str, cfg: PrecisionConfig) -> torch.dtype:
    """The dtype the base model is loaded in: low already when frozen weights will be (no float32 copy first)."""
    return getattr(torch, spec_model_dtype if is_default(cfg) else cfg.param_dtype)
