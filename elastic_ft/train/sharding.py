"""Sharded training (``parallelism.strategy: fsdp``): FSDP2's ``fully_shard`` over the current world.

What a torchtitan user expects: each decoder layer is its own FSDP unit (its parameters all-gathered just
before it runs, freed after), the root holds the rest (embeddings, final norm, output layer); the device
mesh is the current world (``init_device_mesh(world.device.type, ...)``), or, with
``parallelism.shard_size: N``, a 2-D (replicate, shard) mesh: shard within groups of N ranks, replicate
across them (HSDP, titan's dp_replicate x dp_shard). Mixed precision follows the ``precision`` section:
parameters all-gathered in the compute dtype, gradients reduced in float32 (FSDP's MixedPrecisionPolicy).

Without a process group (one process, no torchrun) there is nothing to shard over: the model stays whole
and the same code paths (state dicts, norms) take plain tensors. Checkpoints of an fsdp run are sharded
(DCP, see :mod:`elastic_ft.checkpoint.sharded`) in either case, so they reshard to any world.

The trainer's step calls :func:`gradient_sync` and :func:`total_norm`, which take a DDP model, an FSDP
one or a plain one alike; the strategy-specific code is here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from elastic_ft.config import ConfigError, ParallelismConfig, PrecisionConfig

LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")
"""Attribute names of the decoder-layer list in Hugging Face models (Llama/Mistral/Qwen: ``model.layers``;
GPT-2/Falcon/Bloom: ``transformer.h``; others ``blocks``/``layer``)."""


def world_problem(cfg: ParallelismConfig, world_size: int) -> tuple[str, str] | None:
    """Why the current world cannot be sharded as ``cfg`` says, as (field, message), or None.

    Checked at every (re)start: an elastic job meets worlds of many sizes, and the 2-D mesh of
    ``shard_size`` needs a world of whole groups.
    """
    n = cfg.shard_size
    if cfg.strategy != "fsdp" or n is None or world_size % n == 0:
        return None
    return ("parallelism.shard_size", f"{n} does not divide the current world of {world_size} rank(s): hybrid "
                                      f"sharding needs whole groups of {n}; set it to a size that divides every "
                                      f"world the job runs at (e.g. the GPUs per node, with whole nodes joining "
                                      f"and leaving), or null to shard over the whole world")


def check_world(cfg: ParallelismConfig, world_size: int) -> None:
    """Raise :class:`ConfigError` naming the field when the world cannot be sharded (see :func:`world_problem`)."""
    problem = world_problem(cfg, world_size)
    if problem is not None:
        raise ConfigError([problem])


def mesh_shape(world_size: int, shard_size: int | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dim names) of the device mesh: 1-D over the world, or (replicate, shard) groups of ``shard_size``."""
    if shard_size is None or shard_size == world_size:
        return (world_size,), ("shard",)
    return (world_size // shard_size, shard_size), ("replicate", "shard")


def mixed_precision(cfg: PrecisionConfig):
    """FSDP's policy for the ``precision`` section: all-gather parameters in the compute dtype (frozen ones are
    stored in it already, trainable ones in float32), reduce gradients in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = None if cfg.compute == "float32" else getattr(torch, cfg.compute)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers, found by name through any wrapper (peft's, a CausalLM head's).

    The ModuleList named as in :data:`LAYER_LIST_NAMES` holding the most parameters; failing any, the
    largest ModuleList of modules of one class. Raises ValueError when the model has none.
    """
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1]
    named = [(n, m) for n, m in lists if n.rsplit(".", 1)[-1] in LAYER_LIST_NAMES]

    def size(item) -> int:
        return sum(p.numel() for p in item[1].parameters())
    if named or lists:
        return max(named or lists, key=size)[1]
    raise ValueError(f"{type(model).__name__} has no list of layers to shard (nn.ModuleList)")


def shard(model: nn.Module, parallelism: ParallelismConfig, policy: PrecisionConfig, device: torch.device,
          world_size: int) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (in place; returns ``model``, now an FSDPModule).

    The process group must be up. Parameters become DTensors: build the optimizer after this. A 4-bit
    base's packed weights are sharded like any frozen weight (stored as bfloat16 for it,
    :data:`elastic_ft.train.quantization.SHARDED_STORAGE`); each all-gathered weight is a plain tensor,
    and bitsandbytes' ``Linear4bit`` gives it back its quantization state, which every rank keeps whole
    (one byte per 64 weights with double quantization: 1/32 of the packed bytes).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape, names = mesh_shape(world_size, parallelism.shard_size)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    mp = mixed_precision(policy)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by the backward pass: keeping them
        # gathered saves one all-gather (what torchtitan does).
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def load_device(parallelism: ParallelismConfig, device: torch.device, distributed: bool,
                quantized: bool = False) -> torch.device | None:
    """Where a pretrained model's weights are loaded: ``device``, or the host (None) when the model is to
    be sharded.

    Under fsdp a rank never holds the whole model on its device: it is read into host memory (one copy
    per rank, in its frozen dtype), and ``fully_shard`` moves each unit to the device as it shards it
    (FSDP2 moves a unit's parameters, then keeps only this rank's shard), so the device's peak is the
    shards plus one decoder layer whole. That is what lets a base that does not fit one device train.

    A ``quantized`` (4-bit) base is the exception: it is quantized on the device as it loads, as under
    ddp, and then sharded there, so a rank's peak is the whole 4-bit base once (5.7 GB for an 8B model),
    its shards after; the 4-bit base must fit one device while it loads. Each weight's quantization state
    (scales, code tables) is an attribute, not a parameter: loaded on the device it is where the packed
    bytes are, with no reliance on FSDP's move of the parameters carrying it along (not tried on a GPU).
    """
    if quantized:
        return device
    return None if distributed and parallelism.strategy == "fsdp" else device


def wrap(model: nn.Module, parallelism: ParallelismConfig, policy: PrecisionConfig, device: torch.device,
         world_size: int, distributed: bool) -> nn.Module:
    """The network the step runs (``model`` already on ``device``): DDP's wrapper, the model sharded in place
    (fsdp), or the model itself on a single process. Build the optimizer over the parameters after this."""
    if not distributed:
        return model
    if parallelism.strategy == "fsdp":
        return shard(model, parallelism, policy, device, world_size)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(net: nn.Module, last: bool):
    """The context of one micro-batch's backward: gradients reduced over ranks on the ``last`` one only.

    DDP: ``no_sync()`` before the last; FSDP: ``set_requires_gradient_sync`` (the unsharded gradients
    accumulate locally, one reduce-scatter at the end); a plain model: nothing to sync.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(net, DistributedDataParallel):
        return contextlib.nullcontext() if last else net.no_sync()
    if is_sharded(net):
        net.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def lockstep(chunks: list[list[int]], count: int, filler: list[int] | None = None) -> list[tuple[list[int], float]]:
    """The step's micro-batches as (samples, loss weight), ``count`` of them: ``chunks`` at weight 1, then
    repeats of the first (of ``filler`` when the rank has none) at weight 0.

    Under FSDP every forward and backward runs collectives (each layer's all-gather, the last backward's
    reduce-scatter), so every rank must run as many micro-batches as the busiest rank: an uneven deal (9
    samples over 2 ranks in micro-batches of 4: 2 and 1 micro-batches) would otherwise leave one rank
    waiting in an all-gather the other never starts. A repeat weighted 0 adds nothing to the gradient or
    the loss. DDP communicates once per step, in the last backward, so there ``count`` is the rank's own
    micro-batches, but at least one: a rank dealt no sample (``BatchPlan.idle_ranks``, a world larger
    than ``constant_global``'s batch) still runs one zero-weight backward, so that it joins the gradient
    all-reduce with zero gradients and DDP's average over the whole world (which the loss's
    world/global-tokens scale assumes) stays exact.
    """
    first = chunks[0] if chunks else filler
    if count > len(chunks) and not first:
        raise ValueError("lockstep: a rank with no samples needs a filler sample for its zero-weight micro-batch")
    return [(c, 1.0) for c in chunks] + [(first, 0.0)] * (count - len(chunks))


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of ``grads``: of the whole gradient when they are DTensor shards (one all-reduce).

    A DTensor's norm is a partial value per rank; ``full_tensor()`` reduces it. Plain (replicated) gradients
    give their norm as it is, the same on every rank.
    """
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
