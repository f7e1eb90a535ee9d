"""Q-LoRA's 4-bit base (``quantization.load_in_4bit``) and the spec rules around it, in this process.

What it proves: the frozen base is bitsandbytes' ``Linear4bit`` and its decoder weights take about a quarter
of their bfloat16 bytes (measured on the tensors); quantization is deterministic across processes (the same
bytes in two fresh interpreters with different thread counts as here); adapters and optimizer state are
float32 and a checkpoint holds them only; bad combinations are one line naming the field. Training through
the real trainer, its loss falling, is here too (one rank), as is the 8B spec's recipe (``all-linear`` with
gradient checkpointing, without PEFT's ``prepare_model_for_kbit_training``); killed and resumed at another
world size is tests/e2e/test_qlora_resume.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from elastic_ft.config import ConfigError, load_spec
from elastic_ft.config import validation
from elastic_ft.train import model as model_mod
from elastic_ft.train import quantization
from tests.conftest import DEFAULT_SPEC, REPO
from tests.unit.inprocess import train

Q4 = ["quantization.load_in_4bit=true"]


def problems(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_spec(DEFAULT_SPEC, list(overrides))
    return dict(info.value.problems)


def state_digest(model) -> str:
    """sha256 of the model's state dict (4-bit weights serialised with their quantization state)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


DIGEST_SCRIPT = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from elastic_ft.config import load_spec
from elastic_ft.train import model as model_mod
from elastic_ft.train import quantization
from tests.unit.test_qlora import state_digest
spec = load_spec(sys.argv[2], ["quantization.load_in_4bit=true"])
tok = model_mod.build_tokenizer(spec.model)
base = model_mod.build_base(spec.model, tok, spec.seed, spec.precision, None, spec.quantization)
print("DIGEST", state_digest(base))
"""


def test_bad_combinations_name_the_field():
    assert problems(*Q4, "lora=null")["quantization.load_in_4bit"].startswith("needs a lora section")
    assert "quantization.load_in_4bit" in problems(*Q4, "model.dtype=bfloat16")["model.dtype"]
    assert problems(*Q4, "quantization.quant_type=int4") == {
        "quantization.quant_type": "'int4' is not one of 'nf4', 'fp4'"}
    assert problems(*Q4, "quantization.compute_dtype=float64")["quantization.compute_dtype"].startswith("'float64'")
    assert "even lora.r" in problems("lora.init_lora_weights=orthogonal", "lora.r=3")["lora.init_lora_weights"]
    assert "4-bit base" in problems(*Q4, "lora.init_lora_weights=orthogonal")["lora.init_lora_weights"]
    assert problems("lora.target_modules=q_proj") == {
        "lora.target_modules": "must be a list of str or 'all-linear', got 'q_proj'"}


def test_a_4bit_base_under_fsdp_validates():
    """Sharded since FSDP2 shards the packed weights (tests/unit/test_sharded_training.py trains it)."""
    # load_spec raises ConfigError, naming each problem, for a spec it refuses.
    assert load_spec(DEFAULT_SPEC, [*Q4, "parallelism.strategy=fsdp"]).quantization.load_in_4bit


def test_load_in_4bit_without_bitsandbytes_names_the_field_and_the_extra(monkeypatch):
    real = validation.importlib.util.find_spec
    monkeypatch.setattr(validation.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    message = problems(*Q4)["quantization.load_in_4bit"]
    assert message == "needs the bitsandbytes package, which is not installed: pip install 'elastic-ft[qlora]'"
    load_spec(DEFAULT_SPEC)  # nothing asks for it without load_in_4bit


def test_float16_frozen_weights_beside_a_4bit_base_are_refused():
    """Measured before refusing: the forward pass fails under bfloat16 autocast (float16 activations)."""
    message = problems(*Q4, "precision.param_dtype=float16", "precision.compute=bfloat16")["precision.param_dtype"]
    assert "float16 does not train with a 4-bit base" in message
    load_spec(DEFAULT_SPEC, [*Q4, "precision.param_dtype=bfloat16", "precision.compute=bfloat16"])


def test_hash_is_unchanged_by_the_new_sections_at_their_defaults_and_changed_by_4bit():
    plain = load_spec(DEFAULT_SPEC)
    doc = plain.to_dict()
    assert doc["quantization"]["load_in_4bit"] is False and doc["lora"]["use_dora"] is False
    # The hash of a spec from before these fields existed (runs already committed keep resuming).
    for added in ("use_dora", "use_rslora", "modules_to_save", "init_lora_weights"):
        doc["lora"].pop(added)
    doc.pop("quantization")
    from elastic_ft.config import spec_from_dict

    assert spec_from_dict(doc, check_files=False).hash() == plain.hash()
    assert load_spec(DEFAULT_SPEC, Q4).hash() != plain.hash()
    assert load_spec(DEFAULT_SPEC, ["lora.use_dora=true"]).hash() != plain.hash()


@pytest.mark.slow  # two ~2M-parameter bases
def test_the_base_is_4bit_and_its_decoder_weights_take_a_quarter_of_bfloat16():
    # Wider than the tiny model, so that the per-layer constants (the 1 KB code table) do not dominate.
    wide = ["model.config.hidden_size=256", "model.config.intermediate_size=1024"]
    spec = load_spec(DEFAULT_SPEC, [*Q4, *wide, "precision.param_dtype=bfloat16", "precision.compute=bfloat16"])
    tok = model_mod.build_tokenizer(spec.model)
    q = model_mod.build_base(spec.model, tok, spec.seed, spec.precision, None, spec.quantization)
    bf16 = model_mod.build_base_model(spec.model, tok, spec.seed, torch.bfloat16)
    linears = [n for n, m in q.named_modules() if quantization.is_4bit(m)]
    assert len(linears) == 7 * 2 and all(".layers." in n for n in linears)  # every decoder Linear, not lm_head
    assert type(q.get_output_embeddings()).__name__ == "Linear"
    layers_q = quantization.weight_bytes(q.model.layers)
    layers_bf16 = quantization.weight_bytes(bf16.model.layers)
    ratio = layers_q / layers_bf16
    # nf4: 0.5 byte a weight, plus 8-bit scales per 64 weights (double quant) and small tables: 0.26 here.
    assert 0.24 < ratio < 0.30, (layers_q, layers_bf16)
    whole = quantization.weight_bytes(q) / quantization.weight_bytes(bf16)
    print(f"decoder layers: {layers_q} B 4-bit vs {layers_bf16} B bfloat16 ({ratio:.3f}); whole base {whole:.3f}")


@pytest.mark.subprocess
@pytest.mark.slow
def test_quantization_gives_the_same_bytes_in_every_process():
    spec = load_spec(DEFAULT_SPEC, Q4)
    tok = model_mod.build_tokenizer(spec.model)
    here = state_digest(model_mod.build_base(spec.model, tok, spec.seed, spec.precision, None, spec.quantization))
    env = {**os.environ, "PYTHONPATH": REPO}
    digests = []
    for threads in (1, 2):
        proc = subprocess.run([sys.executable, "-c", DIGEST_SCRIPT, str(threads), DEFAULT_SPEC], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests += [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("DIGEST ")]
    assert digests == [here, here]
    other = load_spec(DEFAULT_SPEC, [*Q4, "seed=1"])
    base = model_mod.build_base(other.model, tok, other.seed, other.precision, None, other.quantization)
    assert state_digest(base) != here  # the digest sees the weights


@pytest.mark.slow
def test_qlora_trains_its_adapters_in_float32_and_checkpoints_only_them(tmp_path):
    from elastic_ft.checkpoint.reader import load_newest
    from elastic_ft.checkpoint.store import open_store

    run = train(tmp_path, "q", *Q4, "steps=6")
    assert run.losses[-1] < run.losses[0] - 0.5, run.losses
    store = open_store(f"file://{tmp_path}/q")
    loaded, _ = load_newest(store, "q")
    weights, optim = loaded.tensors["model"], loaded.tensors["optimizer"]
    assert weights and all(".lora_A." in n or ".lora_B." in n for n in weights)
    assert all(t.dtype == torch.float32 for t in [*weights.values(), *optim.values()] if t.is_floating_point())
    adapter_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert sum(t.numel() * t.element_size() for t in optim.values()) <= 2 * adapter_bytes + 8 * len(weights)
    assert not any(n.endswith(("absmax", "quant_map")) or "quant_state" in n for n in [*weights, *optim])
    assert sum(quantization.is_4bit(m) for m in run.trainer.model.modules()) == 14  # trained on the 4-bit base


def test_the_8b_qlora_spec_loads_and_validates_without_a_download():
    spec = load_spec(f"{REPO}/specs/llama-3.1-8b-qlora-spot.yaml")
    assert spec.quantization.load_in_4bit and spec.quantization.quant_type == "nf4"
    assert spec.lora.target_modules == "all-linear" and spec.parallelism.strategy == "ddp"
    assert spec.model.name_or_path.startswith("s3://")  # fetched by each node, not here


def test_a_pretrained_directory_loads_4bit_with_the_bytes_of_the_inline_base(tmp_path):
    """A saved (pretrained) base goes through the same quantization as an inline one: the same bytes."""
    spec = load_spec(DEFAULT_SPEC, Q4)
    tok = model_mod.build_tokenizer(spec.model)
    model_mod.build_base_model(spec.model, tok, spec.seed, torch.float32).save_pretrained(str(tmp_path / "base"))
    tok.save_pretrained(str(tmp_path / "base"))
    saved = load_spec(DEFAULT_SPEC, [*Q4, "model.config=null", f"model.name_or_path={tmp_path / 'base'}"])
    _tok, model = model_mod.build(saved)
    assert sum(quantization.is_4bit(m) for m in model.modules()) == 14
    inline = model_mod.build_base(spec.model, tok, spec.seed, spec.precision, None, spec.quantization)
    assert quantized_digest(model) == quantized_digest(inline)


def quantized_digest(model) -> str:
    """sha256 of the 4-bit weights and their scales only, by module name (PEFT's wrapper names stripped)."""
    h = hashlib.sha256()
    modules = {n.replace(".base_layer", "").replace("base_model.model.", ""): m for n, m in model.named_modules()
               if quantization.is_4bit(m)}
    for name, m in sorted(modules.items()):
        state = m.weight.quant_state
        for t in (m.weight.data, state.absmax, state.state2.absmax if state.nested else None):
            if t is not None:
                h.update(name.encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_bfloat16_dequantization_on_a_gpu_without_it_names_the_field():
    q = load_spec(DEFAULT_SPEC, Q4).quantization
    assert quantization.device_problem(q, "cuda", bf16_supported=False) == (
        "quantization.compute_dtype", "bfloat16 is not supported by this cuda device; use float16 (or float32)")
    assert quantization.device_problem(q, "cuda", bf16_supported=True) is None
    fp16 = load_spec(DEFAULT_SPEC, [*Q4, "quantization.compute_dtype=float16"]).quantization
    assert quantization.device_problem(fp16, "cuda", bf16_supported=False) is None


BNB_PROBE = """
import sys
import elastic_ft.train.loop as loop

seen = {}
loop.run = lambda spec, opts: seen.setdefault("bnb", sys.modules.get("bitsandbytes", "absent"))
from elastic_ft.worker import main

main(["--spec", sys.argv[1], "--checkpoint_uri", "file://" + sys.argv[2], *sys.argv[4:]],
     own_process=sys.argv[3] == "own")
import peft.import_utils

print("hidden" if seen["bnb"] is None else "importable", peft.import_utils.is_bnb_available())
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("process, overrides, expected", [
    ("own", [], "hidden False"),
    ("own", ["quantization.load_in_4bit=true"], "importable True"),
    ("shared", [], "importable True"),  # run in-process (elastic-ft train, tests): the interpreter is left alone
])
def test_a_worker_without_a_4bit_base_never_imports_bitsandbytes(tmp_path, process, overrides, expected):
    """peft imports bitsandbytes whenever it is installed (1.5 s of every worker start, torch's inductor
    with it): the worker's own process (``python -m elastic_ft.worker``, as torchrun starts it) makes it
    unimportable for a spec that does not quantize, before the model's build imports peft; a Q-LoRA spec
    keeps it, and so does a caller running the job in its own interpreter."""
    done = subprocess.run([sys.executable, "-c", BNB_PROBE, DEFAULT_SPEC, str(tmp_path), process, *overrides],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == expected


def test_the_installed_bitsandbytes_has_the_layout_switch_the_trainer_sets():
    """On any host: keep_one_layout relies on Linear4bit's own attribute; a bitsandbytes that renamed it would
    let CPU evaluations repack the weights again without a word."""
    import bitsandbytes as bnb

    assert "support_avx512bf16_for_cpu" in vars(bnb.nn.Linear4bit(64, 64))


def test_an_evaluation_leaves_the_4bit_bytes_as_quantized():
    """bitsandbytes repacks a CPU 4-bit weight in place at a no-grad eval-mode forward (AVX512-BF16 hosts),
    after which training runs another kernel: the trainer's base keeps its layout, so a run that evaluated
    trains on the bytes its resume quantizes (tests/unit/test_sharded_training.py shows the loss under FSDP).
    Without AVX512-BF16 (this test passes either way there) bitsandbytes never repacks."""
    spec = load_spec(DEFAULT_SPEC, Q4)
    tok = model_mod.build_tokenizer(spec.model)
    base = model_mod.build_base(spec.model, tok, spec.seed, spec.precision, None, spec.quantization)
    before = quantized_digest(base)
    base.eval()
    with torch.no_grad():
        base(input_ids=torch.arange(3, 19).reshape(2, 8))
    assert quantized_digest(base) == before
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
                   for m in base.modules() if quantization.is_4bit(m))


RECIPE = [*Q4, "lora.target_modules=all-linear", "lora.dropout=0.1", "precision.param_dtype=bfloat16",
          "precision.compute=bfloat16"]
"""The 8B Q-LoRA spec's recipe on the tiny model: every decoder Linear adapted on a 4-bit base, bfloat16
frozen weights and compute, LoRA dropout on (recomputation must replay its masks)."""


@pytest.mark.slow  # two short runs and two builds in this process: ~15 s on 2 cores
def test_the_8b_recipe_trains_with_checkpointing_as_without_and_every_adapter_gets_a_gradient(tmp_path):
    """``model.gradient_checkpointing`` (non-reentrant) on a 4-bit base with ``all-linear``: the same loss and
    adapter gradients as without it, none of them zero, with no ``prepare_model_for_kbit_training`` (the
    embedding's output does not require grad; model.py's ``apply_lora`` says why it is not called)."""
    from elastic_ft.train import precision

    grads, losses, calls = {}, {}, {}
    for on in (False, True):
        spec = load_spec(DEFAULT_SPEC, [*RECIPE, f"model.gradient_checkpointing={str(on).lower()}"])
        _, model = model_mod.build(spec)
        assert sum(quantization.is_4bit(m) for m in model.modules()) == 14
        adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert len(adapters) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)  # B starts at zero, and so would A's gradient: as after some training
            for n, p in adapters.items():
                if ".lora_B." in n:
                    p.normal_(0, 0.05)
        mlp = model.get_base_model().model.layers[0].mlp
        seen = []
        mlp.register_forward_pre_hook(lambda *_: seen.append(1))
        ids = torch.arange(3, 51).reshape(2, 24)
        torch.manual_seed(11)  # the dropout masks
        with precision.autocast(spec.precision, torch.device("cpu")):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[on], calls[on] = float(loss), len(seen)
        grads[on] = {n: p.grad.clone() for n, p in adapters.items()}
    assert calls == {False: 1, True: 2}  # the layer really recomputes
    assert losses[True] == losses[False]
    for name, grad in grads[False].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7, msg=name)

    plain = train(tmp_path, "plain", *RECIPE, "steps=3")
    ckpt = train(tmp_path, "ckpt", *RECIPE, "steps=3", "model.gradient_checkpointing=true")
    assert len(plain.losses) == 3 and ckpt.losses == pytest.approx(plain.losses, rel=1e-6, abs=0)
    for (name, a), b in zip(plain.trainer.trainable.items(), ckpt.trainer.trainable.values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
