"""The trainer's trainable state as torch.distributed.checkpoint state dicts (sharded checkpoints).

An fsdp run saves ``{"model": {fqn: DTensor}, "optimizer": {"<fqn>::exp_avg": DTensor, "<fqn>::step":
Tensor}}`` (the ``::`` names of :func:`elastic_ft.train.restore.optimizer_tensors`, so every checkpoint
names its tensors alike) through :mod:`elastic_ft.checkpoint.sharded`, and loads it into the same
structure built for the current world: DCP's planner reshards. Only trainable tensors are saved (a
LoRA run on a sharded base saves its adapters); non-tensor state (the optimizer's param groups) goes in
a JSON document, never through DCP's pickled leaves.

Torch's own state-dict APIs (``get_/set_model_state_dict``, ``get_/set_optimizer_state_dict``) do the
mapping between parameter names and FSDP's sharded parameters, for a sharded model and a whole one
alike, so the same code serves an fsdp run at any world and a ddp run reading an fsdp checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

SEP = "::"


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False: only the trainable tensors are given; which ones is checked by the caller
    # (shape_mismatches, and DCP names a tensor the checkpoint lacks).
    return StateDictOptions(ignore_frozen_params=True, strict=False, **kw)


def trainable_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """(the DCP state dict of the trainable weights and their optimizer state, the param groups as JSON data).

    The tensors are the live ones (DTensors under FSDP): stage them (host copies) before training goes on.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in get_model_state_dict(model, options=_options()).items() if k in trainable}
    osd = get_optimizer_state_dict(model, optimizer, options=_options())
    opt = {f"{fqn}{SEP}{k}": v if torch.is_tensor(v) else torch.tensor(v)
           for fqn, state in osd["state"].items() for k, v in state.items()}
    groups = [{k: (list(v) if isinstance(v, (tuple, list)) else v) for k, v in g.items()}
              for g in osd["param_groups"]]
    return {"model": weights, "optimizer": opt}, groups


def template(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The state dict of the current world that a sharded checkpoint loads into, in place.

    Fresh tensors of the live ones' shapes and placements (the optimizer's state made by torch first, at
    zero: its ``step`` and moments exist only after a step), so a failed load leaves the model untouched.
    """
    state, _ = trainable_state(model, optimizer)
    return {group: {k: torch.empty_like(v) for k, v in tensors.items()} for group, tensors in state.items()}


def apply(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, *, full: bool = False) -> None:
    """Put a loaded ``state`` (:func:`template`'s structure) into the model and optimizer.

    ``full``: the tensors are whole (a replicated checkpoint), and the model is sharded: torch
    distributes each rank's part (every rank holds the whole tensor, no communication).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    set_model_state_dict(model, dict(state["model"]), options=_options(full_state_dict=full))
    per_param: dict[str, dict] = {}
    for key, value in state["optimizer"].items():
        fqn, _, field = key.rpartition(SEP)
        per_param.setdefault(fqn, {})[field] = value
    # The current param groups (the step's LR is set before each step anyway), their fqns the keys.
    groups = get_optimizer_state_dict(model, optimizer, options=_options())["param_groups"]
    set_optimizer_state_dict(model, optimizer, {"state": per_param, "param_groups": groups},
                             options=_options(full_state_dict=full))
