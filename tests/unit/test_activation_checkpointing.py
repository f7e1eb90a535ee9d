"""model.gradient_checkpointing: the same losses and weights as without it, and the layers really recompute."""

from __future__ import annotations

import pytest
import torch

from elastic_ft.config import ConfigError, load_spec
from elastic_ft.train import model as model_mod
from tests.conftest import DEFAULT_SPEC
from tests.unit.inprocess import train


@pytest.mark.slow  # trains in this process: over 10 s on 2 cores
def test_checkpointing_gives_the_same_loss_over_steps(tmp_path):
    # LoRA dropout on: recomputation must replay the same masks.
    plain = train(tmp_path, "plain", "lora.dropout=0.1")
    ckpt = train(tmp_path, "ckpt", "lora.dropout=0.1", "model.gradient_checkpointing=true")
    assert len(plain.losses) == 6
    assert ckpt.losses == pytest.approx(plain.losses, rel=1e-6, abs=0)
    for (name, a), b in zip(plain.trainer.trainable.items(), ckpt.trainer.trainable.values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_each_layer_runs_twice_per_backward_with_checkpointing():
    """Proof that it is on: a decoder layer's MLP starts again in the backward pass."""
    counts = {}
    for on in (False, True):
        spec = load_spec(DEFAULT_SPEC, [f"model.gradient_checkpointing={str(on).lower()}"])
        _, model = model_mod.build(spec)
        mlp = model.get_base_model().model.layers[0].mlp
        calls = []
        # A pre-hook: torch's recompute stops early, once the last tensor the backward needs is back.
        mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        ids = torch.randint(0, 200, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        counts[on] = len(calls)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert counts == {False: 1, True: 2}


def test_a_model_without_checkpointing_support_names_the_field():
    class Plain(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        model_mod.enable_gradient_checkpointing(Plain())
