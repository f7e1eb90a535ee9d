"""The 4-bit base of Q-LoRA (``quantization.load_in_4bit``): bitsandbytes' settings, telling its 4-bit
modules apart, counting their bytes, and dequantizing them for a merged export.

Loading the base quantized is :func:`elastic_ft.train.model.build_quantized_base` (transformers quantizes
as it loads). Nothing here imports bitsandbytes at module level: a spec without a 4-bit base never needs it.
Costs: each function is one pass over the model's modules or weights (grows with the model only).
"""

from __future__ import annotations

import sys

import torch

from elastic_ft.config import QuantizationConfig


def keep_bitsandbytes_out(q: QuantizationConfig) -> None:
    """In a process whose base is not 4-bit, make bitsandbytes unimportable before anything imports peft.

    peft imports bitsandbytes whenever it is installed (the ``qlora`` extra), and bitsandbytes imports
    torch's inductor: 1.5 s more of every worker start here, paid at every restart by runs that never
    quantize. ``None`` in ``sys.modules`` is the import system's own "not importable" entry: ``import``
    raises ModuleNotFoundError and ``importlib.util.find_spec`` answers None, which is how peft and
    transformers ask. A process-wide choice, so only the worker's entry point makes it (in-process tests
    build several specs), and never once bitsandbytes is loaded."""
    if not q.load_in_4bit and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]


SHARDED_STORAGE = torch.bfloat16
"""The dtype the packed 4-bit weights are stored as under ``parallelism.strategy: fsdp`` (bitsandbytes'
``quant_storage``, the FSDP-QLoRA recipe of axolotl, TRL and Answer.AI): the same bytes, viewed as bfloat16,
so that FSDP2's mixed precision, which casts every floating parameter to ``precision.compute`` (bfloat16,
or nothing for float32), never converts them. Measured (torch 2.13.0 CPU, bitsandbytes 0.50.2, gloo, 1 and
2 ranks, LoRA on every projection of the tiny Llama, 3 AdamW steps): bfloat16 and uint8 storage both train
to DDP's losses exactly; float32 storage with bfloat16 compute is cast by the all-gather and fails at the
first matmul ("shape '[64, 32]' is invalid for input of size 1024")."""


def bnb_config(q: QuantizationConfig, sharded: bool = False):
    """transformers' ``BitsAndBytesConfig`` for the ``quantization`` section (4-bit; the output layer is
    left unquantized, transformers' default, as axolotl and TRL do); ``sharded``: stored as
    :data:`SHARDED_STORAGE`, for FSDP (the default uint8 otherwise, what a user's own load gives)."""
    from transformers import BitsAndBytesConfig

    storage = {"bnb_4bit_quant_storage": SHARDED_STORAGE} if sharded else {}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, q.compute_dtype), **storage)


def keep_one_layout(model) -> None:
    """Make each 4-bit module of ``model`` keep the layout it was quantized in (in place).

    On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place, quant state included, at its
    first forward in eval mode without gradients (an evaluation), and from then on multiplies with another
    kernel. Measured on the tiny model: the training step after an evaluation gave 5.538504 where the same
    step without it gave 5.538363, so a run that evaluated and its resume from a checkpoint before that
    evaluation would part; under FSDP the repacked quant state then meets the next all-gather's
    unrepacked bytes (loss 5.672 for 5.538). GPUs never repack; on a CPU evaluation costs the plain kernel.

    The switch is bitsandbytes' own attribute (0.50: ``Linear4bit.support_avx512bf16_for_cpu``); a version
    without it would take the assignment silently and repack all the same, so its absence is an error
    (the ``qlora`` extra asks for a version that has it).
    """
    for module in model.modules():
        if is_4bit(module):
            if not hasattr(module, "support_avx512bf16_for_cpu"):
                import bitsandbytes

                raise RuntimeError(
                    f"bitsandbytes {bitsandbytes.__version__}'s Linear4bit has no support_avx512bf16_for_cpu "
                    "switch, which keeps a CPU 4-bit weight in the layout it was quantized in; install the "
                    "version the qlora extra names (pip install 'elastic-ft[qlora]')")
            module.support_avx512bf16_for_cpu = False


def is_4bit(module) -> bool:
    """Whether ``module`` is bitsandbytes' ``Linear4bit`` (not PEFT's LoRA wrapper of one, of the same name;
    checked by name: no import)."""
    cls = type(module)
    return cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")


def weight_bytes(module) -> int:
    """Bytes the weights of ``module`` hold: every parameter's storage, and for a 4-bit weight its packed
    bytes plus its quantization state (per-block scales, their own scales under double quantization, the
    code tables), so that a 4-bit base is compared fairly with an unquantized one."""
    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        while state is not None:
            total += sum(t.numel() * t.element_size() for t in (state.absmax, state.code) if t is not None)
            offset = getattr(state, "offset", None)
            total += 0 if offset is None else offset.numel() * offset.element_size()
            state = getattr(state, "state2", None)
    return total


def dequantize(model, dtype: torch.dtype):
    """``model`` (in place) with each 4-bit Linear replaced by a plain one holding its dequantized weight in
    ``dtype``, and every other weight cast to ``dtype``: the copy an adapter merges into, equal to what each
    matmul of training multiplied with when ``dtype`` is the compute dtype. Not transformers' ``dequantize()``:
    measured here, its weights differ from bitsandbytes' own dequantization by up to 0.3 on the tiny model."""
    import bitsandbytes.functional as bnb_functional

    for name, module in list(model.named_modules()):
        if not is_4bit(module):
            continue
        weight = bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state).to(dtype)
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                 device=weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if module.bias is not None:
                linear.bias.copy_(module.bias.to(dtype))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, linear)
    # What transformers keeps of the quantization: its config would be saved (and re-applied on load), and
    # its quantization method makes the cast below refuse.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    return model.to(dtype)


def device_problem(q: QuantizationConfig, device_type: str, bf16_supported: bool) -> tuple[str, str] | None:
    """Why a device of ``device_type`` cannot dequantize to ``q.compute_dtype``, as (field, message), or None
    (a T4 or V100 has no bfloat16: checked before the base is loaded, not at the first matmul)."""
    if q.load_in_4bit and q.compute_dtype == "bfloat16" and not bf16_supported:
        return ("quantization.compute_dtype", f"bfloat16 is not supported by this {device_type} device; "
                                              f"use float16 (or float32)")
    return None
