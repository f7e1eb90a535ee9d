"""Mixed precision: frozen weights low, trainable weights and optimizer state float32, compute under autocast.

The parity test runs the real trainer twice on CPU (bfloat16 vs float32) and
states its tolerance; the spec rules and device checks are pure and tested as such.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from elastic_ft.checkpoint.reader import load_newest
from elastic_ft.checkpoint.store import open_store
from elastic_ft.config import ConfigError, PrecisionConfig, load_spec
from elastic_ft.train import model as model_mod, precision
from tests.conftest import DEFAULT_SPEC
from tests.unit.inprocess import train

BF16 = ["precision.param_dtype=bfloat16", "precision.compute=bfloat16"]
LOSS_TOLERANCE = 1e-3
"""Relative difference allowed between a bfloat16 and a float32 run's step losses over 6 steps
(measured: 7e-5 at most; bf16 rounds each value by up to 0.4%, autocast keeps reductions in float32)."""


def problems(*overrides: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        load_spec(DEFAULT_SPEC, list(overrides))
    return err.value.problems


@pytest.mark.slow  # trains in this process: over 10 s on 2 cores
def test_bf16_compute_matches_fp32_within_tolerance(tmp_path):
    full = train(tmp_path, "fp32")
    low = train(tmp_path, "bf16", *BF16)
    assert len(full.losses) == len(low.losses) == 6
    for a, b in zip(full.losses, low.losses):
        assert abs(a - b) <= LOSS_TOLERANCE * abs(a), (full.losses, low.losses)
    assert full.losses != low.losses  # the low run did compute in bfloat16
    model = low.trainer.model
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    states = {v.dtype for s in low.trainer.optimizer.state.values() for k, v in s.items() if k != "step"}
    assert states == {torch.float32}
    loaded, _ = load_newest(open_store(f"file://{tmp_path}/bf16"), "bf16")
    assert loaded.manifest.step == 6
    assert {t.dtype for t in loaded.tensors["model"].values()} == {torch.float32}


def test_frozen_weights_low_trainable_float32_and_buffers_untouched():
    spec = load_spec(DEFAULT_SPEC, BF16)
    _, model = model_mod.build(spec)
    assert model.training
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} <= {torch.float32}


def test_default_precision_changes_nothing_and_keeps_old_hashes():
    spec = load_spec(DEFAULT_SPEC)
    assert precision.is_default(spec.precision)
    assert isinstance(precision.autocast(spec.precision, torch.device("cpu")), type(precision.autocast(
        PrecisionConfig(), torch.device("cpu"))))
    # The hash as computed before the precision and parallelism sections existed.
    d = dataclasses.asdict(spec)
    for volatile in ("logging", "checkpoint", "spot", "inputs", "name", "steps", "epochs", "precision", "parallelism",
                     "eval"):
        d.pop(volatile)
    d["data"].pop("eval_files")  # added with evaluation: at their defaults they hash as before
    d["data"].pop("eval_fraction")
    d["data"].pop("messages_field")  # added with chat data: unset, it hashes as before
    d["optimizer"].pop("max_nonfinite_steps")
    d["model"].pop("gradient_checkpointing")
    d["model"].pop("loss_chunk_tokens")
    for added in ("quantization",):  # added with Q-LoRA: at its default it hashes as before
        d.pop(added)
    for lora_option in ("use_dora", "use_rslora", "modules_to_save", "init_lora_weights"):
        d["lora"].pop(lora_option)
    old = hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    assert spec.hash() == old
    assert load_spec(DEFAULT_SPEC, ["model.gradient_checkpointing=true"]).hash() == old
    assert load_spec(DEFAULT_SPEC, BF16).hash() != old


def test_legacy_model_dtype_and_precision_together_name_the_field():
    (field, msg), = problems("model.dtype=bfloat16", "precision.param_dtype=bfloat16",
                             "precision.compute=bfloat16")
    assert field == "model.dtype" and "precision.param_dtype: bfloat16" in msg
    load_spec(DEFAULT_SPEC, ["model.dtype=bfloat16"])  # alone it keeps its old meaning


def test_low_weights_need_low_compute():
    (field, msg), = problems("precision.param_dtype=float16")
    assert field == "precision.compute" and "bfloat16" in msg


def test_float16_compute_is_refused_by_name():
    (field, msg), = problems("precision.compute=float16")
    assert field == "precision.compute" and "'bfloat16'" in msg


def test_bf16_on_a_device_without_it_names_each_field():
    cfg = PrecisionConfig(param_dtype="bfloat16", compute="bfloat16")
    got = precision.device_problems(cfg, "cuda", bf16_supported=False)
    assert [f for f, _ in got] == ["precision.param_dtype", "precision.compute"]
    assert "not supported by this cuda device" in got[0][1]
    assert precision.device_problems(cfg, "cuda", bf16_supported=True) == []
    precision.check_device(cfg, torch.device("cpu"))  # CPUs take bfloat16


def test_a_pretrained_base_loads_in_its_frozen_dtype(tmp_path):
    """from_pretrained in bfloat16 directly; the adapters (made by peft in the base's dtype) go back to float32."""
    tokenizer, model = model_mod.build(load_spec(DEFAULT_SPEC))
    base = model.get_base_model()
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    spec = load_spec(DEFAULT_SPEC, [f"model.name_or_path={tmp_path / 'base'}", "model.config=null", *BF16])
    _, low = model_mod.build(spec)
    assert {p.dtype for p in low.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in low.parameters() if p.requires_grad} == {torch.float32}


def test_the_trainer_check_raises_one_config_error_naming_the_fields(monkeypatch):
    """What a worker on a GPU without bfloat16 prints (as every ConfigError: one line per field, exit 2)."""
    monkeypatch.setattr(precision, "bf16_supported", lambda device: False)
    with pytest.raises(ConfigError) as err:
        precision.check_device(load_spec(DEFAULT_SPEC, BF16).precision, torch.device("cuda", 0))
    assert [f for f, _ in err.value.problems] == ["precision.param_dtype", "precision.compute"]
    assert "precision.param_dtype: bfloat16 is not supported by this cuda device" in str(err.value)
