"""The training loss of one micro-batch: token cross-entropy summed over its targets.

Two paths, the same number. The plain one takes the model's logits, the whole
micro-batch's full-vocabulary logits at once (and their float32 copy, and in the
backward their gradient): at a 128k vocabulary that is 0.5 MB per token each,
gigabytes for a few thousand tokens. The chunked one (``model.loss_chunk_tokens``)
runs the model up to the output layer, then the output layer and the loss a
chunk of tokens at a time inside a non-reentrant checkpoint: a chunk's logits
exist only while its loss (forward) or its gradient (backward, recomputed) is
taken, as in Liger's and torchtune's chunked cross-entropy.

The output layer is the model's own module (``get_output_embeddings()``), so a
LoRA adapter on ``lm_head`` and autocast apply to each chunk exactly as they do
in the model's forward, and DDP still drives the forward (its hooks see every
trainable parameter's gradient).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from elastic_ft.config import ConfigError
from elastic_ft.train.data import IGNORE

# Config fields of models that change the logits after the output layer (Gemma 2's soft cap, Cohere's
# scale, Granite's divisor): the chunked path would skip that step, so it refuses them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_model(model, chunk_tokens: int | None) -> None:
    """Raise :class:`ConfigError` naming ``model.loss_chunk_tokens`` when the chunked path cannot serve ``model``."""
    if chunk_tokens is None:
        return
    config = getattr(model, "config", None)
    found = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if found:
        raise ConfigError([("model.loss_chunk_tokens", f"this model transforms its logits after the output layer "
                                                       f"({', '.join(found)}), which the chunked loss does not "
                                                       f"do; set it to null")])
    if model.get_output_embeddings() is None:
        raise ConfigError([("model.loss_chunk_tokens", f"{type(model).__name__} has no output embedding layer; "
                                                       f"set it to null")])


def model_inputs(batch: dict[str, torch.Tensor]) -> dict:
    """What the model's forward takes from a micro-batch: all but the labels (``attention_mask`` for padded
    samples, ``position_ids`` for packed rows: :meth:`~elastic_ft.train.token_store.TokenStore.batch`), and
    ``use_cache=False``: training needs no key/value cache, and with one transformers (5.24,
    ``masking_utils._preprocess_mask_arguments``) does not look for packed sequences in the position ids, so
    a packed row's samples would attend to each other (tests/unit/test_packing.py sees it happen)."""
    return {**{k: v for k, v in batch.items() if k != "labels"}, "use_cache": False}


def padding_free(model) -> bool:
    """Whether packed rows go to ``model`` as one unpadded row per micro-batch: its attention is a
    flash-attention kernel, which keeps the samples apart by their position ids (variable-length
    sequences) only in a batch of one row. Not measured here (no GPU); eager, sdpa and flex build a
    block-diagonal mask from the position ids of padded rows instead."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return "flash" in str(impl)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t's target is token t+1; the last position has none.

    The (small) labels are shifted rather than the (large) logits sliced, which would copy them.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def summed_loss(net, model, batch: dict[str, torch.Tensor], *,
                chunk_tokens: int | None, autocast: Callable[[], ContextManager]) -> torch.Tensor:
    """The micro-batch's cross-entropy summed over its targets (float32), ready for backward.

    ``net`` is what runs the forward (the DDP wrapper or ``model``), ``model`` the (PEFT) model whose
    output embedding module is the output layer, ``autocast`` a factory of the compute context.
    """
    targets = shifted_targets(batch["labels"]).flatten()
    if chunk_tokens is None:
        with autocast():
            logits = net(**model_inputs(batch)).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets, ignore_index=IGNORE, reduction="sum")
    output_layer = model.get_output_embeddings()
    with _hidden_states(output_layer) as captured, autocast():
        net(**model_inputs(batch))
    return chunked_cross_entropy(output_layer, captured[0].flatten(0, 1), targets, chunk_tokens, autocast)


@contextlib.contextmanager
def _hidden_states(output_layer: torch.nn.Module):
    """Within: the output layer's input is put in the yielded list, and the layer is given none of it.

    The model's forward then ends in zero-row logits (nothing computed or kept for the vocabulary),
    while its input, the final hidden states, goes on in the autograd graph through the caller.
    """
    captured: list[torch.Tensor] = []

    def take(_module, args, kwargs):
        (hidden, *rest) = args
        captured.append(hidden)
        return (hidden[..., :0, :], *rest), kwargs

    handle = output_layer.register_forward_pre_hook(take, with_kwargs=True)
    try:
        yield captured
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the model called its output layer {len(captured)} times in one forward; the "
                           f"chunked loss needs exactly one call (set model.loss_chunk_tokens to null)")


def chunked_cross_entropy(output_layer: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int, autocast: Callable[[], ContextManager]) -> torch.Tensor:
    """Sum over ``chunk_tokens``-row chunks of ``hidden`` (tokens, hidden) of their cross-entropy with ``targets``.

    Each chunk is checkpointed: its forward keeps only its input, and the backward recomputes the chunk's
    logits (replaying LoRA dropout's RNG and the autocast state) just before taking their gradient.
    """
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
        total = total + checkpoint(_chunk_loss, output_layer, h, t, autocast, use_reentrant=False)
    return total


def _chunk_loss(output_layer: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                autocast: Callable[[], ContextManager]) -> torch.Tensor:
    with autocast():
        logits = output_layer(hidden)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
