"""model.loss_chunk_tokens: the loss and gradients of the plain path, without the whole logits ever existing."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from elastic_ft.config import ConfigError, load_spec
from elastic_ft.train import data as data_mod
from elastic_ft.train import loss as loss_mod
from elastic_ft.train import model as model_mod
from elastic_ft.train import precision
from tests.conftest import DEFAULT_SPEC
from tests.unit.inprocess import train

FULL = ["lora=null"]
BF16 = ["precision.param_dtype=bfloat16", "precision.compute=bfloat16"]
# GPT-2: dropout in the decoder, and an output layer tied to the input embedding (its gradient has two sources).
GPT2 = ["model.config={model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, n_positions: 64}",
        "lora.target_modules=[c_attn, lm_head]"]


def _setup(*overrides: str):
    spec = load_spec(DEFAULT_SPEC, list(overrides))
    tokenizer, model = model_mod.build(spec)
    data = data_mod.load(spec.data, tokenizer)
    return spec, model, data.batch(list(range(6)))


def _loss_and_grads(spec, model, batch, chunk_tokens):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks in the decoder for both paths
    ce = loss_mod.summed_loss(model, model, batch, chunk_tokens=chunk_tokens,
                              autocast=lambda: precision.autocast(spec.precision, torch.device("cpu")))
    ce.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return ce.detach(), grads


# LoRA (lm_head is one of the default spec's targets: the adapter runs inside every chunk) and a full
# fine-tune; with activation checkpointing; GPT-2. 7 tokens does not divide the micro-batch, 10**6 is one
# chunk. float32 compute: only the order of the final sum differs, so 1e-5. bfloat16 autocast: the same
# per-row bf16 matmuls, 1e-2.
@pytest.mark.parametrize("overrides, rtol", [
    ([], 1e-5), (FULL, 1e-5), (BF16, 1e-2), (["model.gradient_checkpointing=true"], 1e-5), (GPT2, 1e-5),
    ([*GPT2, "lora=null"], 1e-5),
], ids=["lora", "full", "bf16", "activation-checkpointing", "gpt2-tied-lora", "gpt2-tied-full"])
@pytest.mark.parametrize("chunk", [7, 10**6])
def test_same_loss_and_gradients_as_the_whole_logits(overrides, rtol, chunk):
    spec, model, batch = _setup(*overrides)
    plain_loss, plain_grads = _loss_and_grads(spec, model, batch, None)
    loss, grads = _loss_and_grads(spec, model, batch, chunk)
    assert plain_loss.dtype == loss.dtype == torch.float32
    torch.testing.assert_close(loss, plain_loss, rtol=rtol, atol=0)
    assert grads.keys() == plain_grads.keys()
    # The output layer's trained weights (a LoRA adapter, or a weight tied to the input embedding) are compared.
    output = {id(p) for p in model.get_output_embeddings().parameters() if p.requires_grad}
    assert [n for n, p in model.named_parameters() if id(p) in output and n in grads]
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=rtol, atol=rtol * plain_grads[name].abs().max(),
                                   msg=name)


class _VocabRows(TorchDispatchMode):
    """Rows of the tensors whose last dimension is the vocabulary (logits, their float32 copy, softmax,
    their gradients), forward and backward: the largest one allocated, and the most alive at once
    (by their storage, which autograd may keep after the op's own tensor is gone; views are not new memory)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest, self.peak_live = vocab, 0, 0
        self.live: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.numel()
                    and t.untyped_storage().data_ptr() not in inputs):
                rows = t.numel() // self.vocab
                self.largest = max(self.largest, rows)
                self.live.append((StorageWeakRef(t.untyped_storage()), rows))
        self.live = [(ref, rows) for ref, rows in self.live if not ref.expired()]
        self.peak_live = max(self.peak_live, sum(rows for _, rows in self.live))
        return out


@pytest.mark.parametrize("overrides", [[], FULL], ids=["lora", "full"])
def test_no_tensor_holds_more_than_a_chunk_of_logits(overrides):
    spec, model, batch = _setup(*overrides)
    vocab, tokens, chunk = model.config.vocab_size, batch["input_ids"].numel(), 16
    assert vocab != model.config.hidden_size and tokens > 4 * chunk
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: calls.append(out.shape[:-1].numel()))
    seen = {}
    for c in (None, chunk):
        calls.clear()
        with _VocabRows(vocab) as spy:
            _loss_and_grads(spec, model, batch, c)
        seen[c] = (spy.largest, spy.peak_live, list(calls))
    n_chunks = -(-tokens // chunk)
    # The spy sees the whole logits on the plain path, and more than one tensor of them alive at once.
    assert seen[None][0] == tokens and seen[None][1] >= 2 * tokens and seen[None][2] == [tokens]
    largest, peak_live, chunk_calls = seen[chunk]
    assert largest <= chunk and peak_live <= 3 * chunk, (largest, peak_live)
    # The model's own call gets no rows; each chunk runs once forward and once more in the backward.
    assert chunk_calls[0] == 0 and max(chunk_calls) <= chunk and len(chunk_calls) == 1 + 2 * n_chunks


def test_trainer_losses_match_over_steps(tmp_path):
    plain = train(tmp_path, "plain")
    chunked = train(tmp_path, "chunked", "model.loss_chunk_tokens=50")
    assert len(plain.losses) == 6
    assert chunked.losses == pytest.approx(plain.losses, rel=1e-5, abs=0)
    for (name, a), b in zip(plain.trainer.trainable.items(), chunked.trainer.trainable.values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_chunk_size_out_of_range_names_the_field():
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_tokens.*must be in"):
        load_spec(DEFAULT_SPEC, ["model.loss_chunk_tokens=0"])


def test_not_part_of_the_config_hash():
    assert load_spec(DEFAULT_SPEC, ["model.loss_chunk_tokens=64"]).hash() == load_spec(DEFAULT_SPEC).hash()


def test_a_model_that_transforms_its_logits_is_refused_naming_the_field():
    spec, model, _ = _setup()
    loss_mod.check_model(model, None)
    loss_mod.check_model(model, 64)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_tokens.*final_logit_softcapping"):
        loss_mod.check_model(model, 64)
    loss_mod.check_model(model, None)  # the plain path applies the model's own forward


def test_an_output_layer_called_twice_is_an_error_not_a_wrong_loss():
    spec, model, batch = _setup()
    layer = model.get_output_embeddings()

    class Twice(torch.nn.Module):
        def forward(self, **kw):
            h = model.get_base_model().model(**kw).last_hidden_state
            return layer(h) + layer(h)

    with pytest.raises(RuntimeError, match="2 times"):
        loss_mod.summed_loss(Twice(), model, batch, chunk_tokens=8, autocast=contextlib.nullcontext)
