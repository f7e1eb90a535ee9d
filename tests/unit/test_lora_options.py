"""PEFT's LoRA options in the real trainer, one rank in this process: ``use_dora``, ``use_rslora``,
``target_modules: all-linear``, ``modules_to_save``, ``init_lora_weights`` (and DoRA on a 4-bit base).

Each trains (its loss falls), resumes exactly (4 steps uninterrupted against 2, then 2 more from the step-2
checkpoint: the same trainable weights, bit for bit), reaches ``adapter_config.json`` and exports to a
directory ``PeftModel.from_pretrained`` loads with the checkpoint's weights. Then ``export --merge`` for LoRA
and Q-LoRA: greedy generation from the merged model equals the adapter model's. The built model's scale
(alpha / r, rsLoRA's alpha / sqrt(r)) and the 4-bit weights' quant type and double quantization are checked
on the modules themselves.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic_ft.checkpoint.reader import load_newest
from elastic_ft.checkpoint.store import open_store
from elastic_ft.runevents.events import read_events
from elastic_ft.train.export import export
from tests.unit.inprocess import train

pytestmark = pytest.mark.slow  # one to three short runs each

Q4 = "quantization.load_in_4bit=true"
RUN = ["steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=null", "optimizer.schedule=constant"]  # a cosine
# schedule would follow each attempt's own steps=
DECODER = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

# option -> (overrides, what adapter_config.json must say, whether to check the resume). Every option the
# issue names resumes exactly: those adding a kind of trained tensor (DoRA's magnitudes, a module trained in
# full, on a 4-bit base), and rsLoRA's scale and all-linear's targets (a resume that rebuilt the adapters
# with the plain scale or the spec's default targets would not continue the same run); gaussian's start is
# replaced by the checkpoint's weights at a resume, like plain LoRA's (tests/e2e/test_resume.py).
OPTIONS = {
    "dora": (["lora.use_dora=true"], {"use_dora": True}, True),
    "rslora": (["lora.use_rslora=true"], {"use_rslora": True}, True),
    "all-linear": (["lora.target_modules=all-linear"], {"target_modules": DECODER}, True),
    "modules_to_save": (["lora.target_modules=[q_proj,v_proj]", "lora.modules_to_save=[lm_head]"],
                        {"modules_to_save": ["lm_head"]}, True),
    "gaussian": (["lora.init_lora_weights=gaussian"], {"init_lora_weights": "gaussian"}, False),
    "qlora-dora": ([Q4, "lora.use_dora=true"], {"use_dora": True}, True),
    "qlora-modules_to_save": ([Q4, "lora.target_modules=[q_proj,v_proj]", "lora.modules_to_save=[lm_head]"],
                              {"modules_to_save": ["lm_head"]}, True),  # a full float32 lm_head beside 4 bits
}


def checkpoint_weights(root, run_id: str) -> dict[str, torch.Tensor]:
    store = open_store(f"file://{root}/{run_id}")
    try:
        loaded, _ = load_newest(store, run_id)
    finally:
        store.close()
    return loaded.tensors["model"]


def load_adapter(out, quantization=None):
    """The exported adapter on its exported base (4-bit when ``quantization`` is given), as a user loads it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from elastic_ft.train.quantization import bnb_config

    kwargs = {} if quantization is None else {"quantization_config": bnb_config(quantization),
                                              "device_map": {"": "cpu"}}
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "base"), **kwargs), str(out))


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_trains_resumes_exactly_and_exports_what_peft_loads(tmp_path, option):
    overrides, expected, resume = OPTIONS[option]
    ref = train(tmp_path, "ref", *RUN, *overrides)
    assert ref.losses[-1] < ref.losses[0], ref.losses
    weights = checkpoint_weights(tmp_path, "ref")
    if resume:
        train(tmp_path, "cut", *RUN, *overrides, "steps=2")
        train(tmp_path, "cut", *RUN, *overrides)
        events = read_events(os.path.join(tmp_path, "cut", "logs", "events.jsonl"))
        assert [e["step"] for e in events if e["event"] == "resume_plan"] == [0, 2]
        assert sorted(checkpoint_weights(tmp_path, "cut")) == sorted(weights)
        for name, tensor in checkpoint_weights(tmp_path, "cut").items():
            torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    if option.endswith("dora"):
        assert any(".lora_magnitude_vector." in n for n in weights)
    if option.endswith("modules_to_save"):
        assert "base_model.model.lm_head.modules_to_save.default.weight" in weights
        assert weights["base_model.model.lm_head.modules_to_save.default.weight"].dtype == torch.float32

    out = tmp_path / "adapter"
    assert export(f"file://{tmp_path}/ref", str(out)) == {"step": 4, "out": str(out), "lora": True}
    config = json.loads((out / "adapter_config.json").read_text())
    for key, value in expected.items():
        # all-linear is saved resolved, as the full names of the modules it matched
        got = {n.rsplit(".", 1)[-1] for n in config[key]} if isinstance(value, set) else config[key]
        assert got == value, (key, config[key])
    model = load_adapter(out)
    params = dict(model.named_parameters())
    for name, tensor in weights.items():
        torch.testing.assert_close(params[name].detach().float(), tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("overrides, scale", [([], 16 / 8), (["lora.use_rslora=true"], 16 / 8 ** 0.5),
                                              (["lora.use_rslora=true", "lora.r=4"], 16 / 2)],
                         ids=["alpha/r", "rslora", "rslora-r4"])
def test_the_built_adapters_scale_by_alpha_over_r_or_its_square_root(overrides, scale):
    """rsLoRA's scale is alpha / sqrt(r) (16 / sqrt(8) here), plain LoRA's alpha / r, on every adapted layer of
    the model the trainer builds (what a resume must rebuild, too)."""
    from elastic_ft.config import load_spec
    from elastic_ft.train import model as model_mod
    from tests.conftest import DEFAULT_SPEC

    spec = load_spec(DEFAULT_SPEC, overrides)
    assert spec.lora.alpha == 16
    _, model = model_mod.build(spec)
    scales = [m.scaling["default"] for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "lora_A")]
    assert len(scales) == 7 * 2 + 1  # every projection of both layers, and lm_head
    assert scales == pytest.approx([scale] * len(scales), rel=1e-12, abs=0)


@pytest.mark.parametrize("overrides, quant_type, nested", [
    (["quantization.quant_type=fp4"], "fp4", True), (["quantization.double_quant=false"], "nf4", False)],
    ids=["fp4", "no-double-quant"])
def test_fp4_and_single_quantization_reach_the_4bit_weights(overrides, quant_type, nested):
    from elastic_ft.config import load_spec
    from elastic_ft.train import model as model_mod
    from elastic_ft.train.quantization import is_4bit
    from tests.conftest import DEFAULT_SPEC

    spec = load_spec(DEFAULT_SPEC, [Q4, *overrides])
    tok = model_mod.build_tokenizer(spec.model)
    base = model_mod.build_base(spec.model, tok, spec.seed, spec.precision, None, spec.quantization)
    states = [m.weight.quant_state for m in base.modules() if is_4bit(m)]
    assert len(states) == 14
    assert {(s.quant_type, s.nested) for s in states} == {(quant_type, nested)}


def greedy(model, tokenizer, prompt: str, tokens: int = 6) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_merged_export_generates_what_the_adapter_model_does(tmp_path, qlora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elastic_ft.config import load_spec
    from tests.conftest import DEFAULT_SPEC

    extra = [Q4] if qlora else []
    train(tmp_path, "run", *RUN, *extra, "optimizer.lr=1e-2")
    adapter, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    export(f"file://{tmp_path}/run", str(adapter))
    result = export(f"file://{tmp_path}/run", str(merged_dir), merge=True)
    assert result == {"step": 4, "out": str(merged_dir), "lora": False,
                      "merged_dtype": "bfloat16" if qlora else "float32"}
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config and not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    assert merged.dtype == (torch.bfloat16 if qlora else torch.float32)
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(str(adapter / "base"))  # the adapters were merged in
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (merged.get_parameter(name).float() - base.get_parameter(name)).abs().max() > 1e-3
    quantization = load_spec(DEFAULT_SPEC, [Q4]).quantization if qlora else None
    tuned = load_adapter(adapter, quantization)  # Q-LoRA: on the 4-bit base it was trained on
    if qlora:
        assert sum(type(p).__name__ == "Params4bit" for p in tuned.parameters()) == 14
    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    for prompt in ("What is 2 + 3?", "Name a colour."):
        assert greedy(merged, tokenizer, prompt) == greedy(tuned, tokenizer, prompt), prompt


def test_merge_of_a_full_fine_tune_is_refused_in_one_line(tmp_path):
    from elastic_ft.config import ConfigError

    train(tmp_path, "full", "lora=null", "steps=1", "checkpoint.every_steps=1")
    with pytest.raises(ConfigError) as info:
        export(f"file://{tmp_path}/full", str(tmp_path / "out"), merge=True)
    assert info.value.problems == [("lora", "is null (a full fine-tune): its export is a whole model already; "
                                            "drop --merge")]
    assert not (tmp_path / "out").exists()
