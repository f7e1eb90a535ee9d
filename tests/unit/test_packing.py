"""data.packing: whole samples in max_length rows, each sample's attention and loss its own.

On the real tiny Llama (built from the default spec's config): packed rows give the loss and gradients
of the same samples trained one by one, in both layouts (rows padded to the longest, for eager/sdpa;
one unpadded row, the layout flash-attention gets), and the attention probabilities themselves (eager's
``output_attentions``; sdpa's, recomputed from the very mask and inputs torch's kernel is called with)
are zero across every sample boundary. The rows hold every sample exactly once, and a rank's items
group into micro-batches by length.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from elastic_ft.config import DataConfig, load_spec
from elastic_ft.train import data as data_mod
from elastic_ft.train import loss as loss_mod
from elastic_ft.train import model as model_mod
from elastic_ft.train.micro_batches import micro_batches
from elastic_ft.train.token_packing import pack
from elastic_ft.train.token_store import IGNORE
from tests.conftest import DEFAULT_SPEC

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MAX_LENGTH = 48


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "node-cache"))


@pytest.fixture
def stores(cache, tmp_path):
    """The same 14 prompt/response samples (6 to 48+ tokens, some cut at max_length), unpacked and packed."""
    rng = np.random.default_rng(3)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": " ".join(rng.choice(WORDS, rng.integers(0, 4))),
                                        "a": " " + " ".join(rng.choice(WORDS, rng.integers(1, 8)))}) + "\n"
                            for _ in range(14)))
    tok = model_mod.byte_tokenizer()
    cfg = DataConfig(files=[str(path)], prompt_field="q", response_field="a", max_length=MAX_LENGTH)
    plain = data_mod.load(cfg, tok)
    packed = data_mod.load(DataConfig(**{**cfg.__dict__, "packing": True}), tok)
    return plain, packed


GPT2 = "model.config={model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, n_positions: 64}"


def tiny_llama(attn: str, *overrides: str):
    spec = load_spec(DEFAULT_SPEC, ["lora=null", *overrides])
    tokenizer, model = model_mod.build(spec)
    model.set_attn_implementation(attn)
    # GPT-2's dropout draws its masks by tensor shape, which packing changes: compare without it (eval mode
    # still builds the same masks and takes the same gradients).
    return model.eval()


def loss_and_grads(model, batches):
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        ce = loss_mod.summed_loss(model, model, batch, chunk_tokens=None, autocast=contextlib.nullcontext)
        ce.backward()
        total += ce.detach().double()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Per position, which sequence of its row it is in: a new one wherever the position ids restart."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(-1)


# ---------------------------------------------------------------- the rows


def test_best_fit_decreasing_rows():
    # Decreasing: 6 opens row 0 (4 free), 5 row 1 (5 free), 4 fills row 0 exactly (the tightest fit),
    # 3 and 2 fill row 1.
    offsets, samples = pack(np.array([6, 5, 4, 3, 2]), 10)
    assert [samples[offsets[r]:offsets[r + 1]].tolist() for r in range(len(offsets) - 1)] == [[0, 2], [1, 3, 4]]
    lengths = np.random.default_rng(0).integers(1, 2049, 20_000)
    offsets, samples = pack(lengths, 2048)
    assert sorted(samples.tolist()) == list(range(len(lengths)))  # every sample in exactly one row
    assert np.add.reduceat(lengths[samples], offsets[:-1]).max() <= 2048
    again = pack(lengths, 2048)
    assert np.array_equal(again[0], offsets) and np.array_equal(again[1], samples)
    with pytest.raises(ValueError, match="max_length"):
        pack(np.array([3, 11]), 10)


def test_the_packed_store_holds_every_sample_exactly_once_in_rows_of_max_length(stores):
    plain, packed = stores
    assert packed.header.samples == len(plain) == 14 and 1 <= len(packed) < 14
    held = np.concatenate(packed.samples_of(list(range(len(packed)))))
    assert sorted(held.tolist()) == list(range(14))
    assert packed.micro_lengths(list(range(len(packed)))).max() <= MAX_LENGTH
    everything = list(range(len(packed)))
    assert packed.target_count(everything) == plain.target_count(list(range(14)))
    assert packed.real_tokens(everything) == plain.real_tokens(list(range(14)))


def test_a_packed_batch_restarts_positions_and_no_label_crosses_a_sample_boundary(stores):
    plain, packed = stores
    rows = list(range(len(packed)))
    batch = packed.batch(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    targets = loss_mod.shifted_targets(batch["labels"])
    for r, samples in enumerate(packed.samples_of(rows)):
        at = 0
        for s in samples.tolist():
            one = plain.batch([s])
            k = int(one["attention_mask"].sum())
            assert batch["input_ids"][r, at:at + k].tolist() == one["input_ids"][0, :k].tolist()
            assert batch["position_ids"][r, at:at + k].tolist() == list(range(k))
            # The targets inside the sample are the sample's own, and its last position predicts nothing.
            assert targets[r, at:at + k].tolist() == loss_mod.shifted_targets(one["labels"])[0, :k].tolist()
            assert targets[r, at + k - 1] == IGNORE
            at += k
        assert (batch["labels"][r, at:] == IGNORE).all()


# ---------------------------------------------------------------- the model


# GPT-2: learned absolute positions (the restarted position ids index them) instead of rotary ones.
@pytest.mark.parametrize("attn, flat, overrides", [("eager", False, []), ("sdpa", False, []), ("sdpa", True, []),
                                                   ("sdpa", False, [GPT2])],
                         ids=["eager-rows", "sdpa-rows", "sdpa-one-row", "gpt2-sdpa-rows"])
def test_packed_rows_give_the_loss_and_gradients_of_the_samples_one_by_one(stores, attn, flat, overrides):
    plain, packed = stores
    model = tiny_llama(attn, *overrides)
    one_by_one, grads = loss_and_grads(model, [plain.batch([s]) for s in range(len(plain))])
    rows = list(range(len(packed)))
    together, packed_grads = loss_and_grads(model, [packed.batch(c, flat=flat) for c in micro_batches(rows, 3)])
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=0)
    assert packed_grads.keys() == grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(packed_grads[name], grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def assert_no_weight_crosses(probs: torch.Tensor, seg: torch.Tensor) -> None:
    """``probs`` (rows, heads, q, k) and ``seg`` (rows, positions): zero wherever q and k are in different
    sequences, and each query's weights sum to 1 inside its own."""
    across = seg[:, None, :, None] != seg[:, None, None, :]
    assert probs.shape[-1] == seg.shape[-1]
    assert probs.masked_select(across.expand_as(probs)).abs().max() == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    assert across.any()  # the check is not vacuous: there are boundaries


def test_no_eager_attention_weight_crosses_a_sample_boundary(stores):
    _, packed = stores
    model = tiny_llama("eager")
    batch = packed.batch(list(range(len(packed))))
    with torch.no_grad():
        out = model(**loss_mod.model_inputs(batch), output_attentions=True)
    assert len(out.attentions) == model.config.num_hidden_layers
    for probs in out.attentions:
        assert_no_weight_crosses(probs, segments(batch["position_ids"]))


@pytest.mark.parametrize("flat", [False, True], ids=["rows", "one-row"])
def test_no_sdpa_attention_weight_crosses_a_sample_boundary(stores, monkeypatch, flat):
    """sdpa returns no weights: they are recomputed from exactly what its kernel is called with."""
    _, packed = stores
    model = tiny_llama("sdpa")
    batch = packed.batch(list(range(len(packed))), flat=flat)
    real = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def watched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1) if enable_gqa else key
        scores = query @ k.transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
        if is_causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        seen.append(scores.softmax(-1))
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)
    with torch.no_grad():
        model(**loss_mod.model_inputs(batch))
    assert len(seen) == model.config.num_hidden_layers
    for probs in seen:
        assert_no_weight_crosses(probs, segments(batch["position_ids"]))


# ---------------------------------------------------------------- micro-batches


def test_a_ranks_items_group_into_micro_batches_by_length():
    items, lengths = [10, 11, 12, 13, 14], [5, 40, 7, 40, 30]
    assert micro_batches(items, 2, lengths) == [[11, 13], [14, 12], [10]]  # ties keep the dealt order
    assert micro_batches(items, 2) == [[10, 11], [12, 13], [14]]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_step_events_count_the_tokens_the_model_really_computed(cache, tmp_path, monkeypatch, packing):
    """The real trainer (in process, the demo corpus): each step event's computed_tokens is the size of the
    micro-batches the model was given, and its real_tokens the samples' tokens, packed or not."""
    from elastic_ft.runevents.events import read_events
    from elastic_ft.train.token_store import TokenStore
    from tests.unit.inprocess import train

    fed: list[tuple[int, int]] = []  # per micro-batch: positions computed, real tokens in it
    cut = TokenStore.batch

    def watched(self, indices, **kw):
        batch = cut(self, indices, **kw)
        fed.append((batch["input_ids"].numel(), self.real_tokens(indices)))
        return batch

    monkeypatch.setattr(TokenStore, "batch", watched)
    run = train(tmp_path, "r", "steps=3", "batch.global_batch=12", "batch.micro_batch=4", f"data.packing={packing}")
    assert len(run.losses) == 3 and all(np.isfinite(run.losses))
    steps = [e for e in read_events(str(tmp_path / "r" / "logs" / "events.jsonl")) if e["event"] == "step"]
    assert sum(e["computed_tokens"] for e in steps) == sum(c for c, _ in fed)
    assert sum(e["real_tokens"] for e in steps) == sum(r for _, r in fed)
    assert sum(c for c, _ in fed) > sum(r for _, r in fed)  # padding there is, and it is counted
