"""Q-LoRA against LoRA on CPU: the frozen base's memory, step time and loss, on a ~100M-parameter Llama built
from a config; and the GPU arithmetic of the two 8B specs beside it (computed, not measured).

Three training modes, each in a fresh process (its memory high-water mark its own): ``lora-fp32`` (the base
in float32), ``lora-bf16`` (``precision.param_dtype/compute: bfloat16``) and ``qlora`` (the base 4-bit nf4
with double quantization, the rest bfloat16). Each builds the model as the trainer does
(:func:`elastic_ft.train.model.build`), then trains LoRA r 16 on every decoder projection for ``--steps``
AdamW steps on the same batch of the tiny corpus. Reported per mode: the base's weight bytes (4-bit weights
with their scales), the process's peak resident memory after building, the median step time, and the last
loss against lora-fp32's. ``qlora`` also reports what PEFT's ``prepare_model_for_kbit_training`` would add
(it casts every unquantized weight to float32): the reason the trainer does not call it.

A model built from a config is drawn in float32 before it is quantized, so the peak RSS of the training
modes includes that float32 model. The frozen base as a user on a GPU loads it is measured apart: the same
base saved once as a bfloat16 pretrained directory (a temporary one), then loaded from it, bfloat16 and
4-bit, each in a fresh process whose libraries are imported before the load: the base's tensor bytes and
the RSS the load adds (after one read of every tensor, and at its peak). The 4-bit load reads each weight in
bfloat16 and quantizes it on the host: what the allocator keeps of those temporaries counts too.

    python bench/qlora.py [--hidden 768] [--layers 12] [--steps 5] [--tokens 128] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD_MODES = ("save-bf16", "load-bf16", "load-4bit")
MODES = {
    "lora-fp32": [],
    "lora-bf16": ["precision.param_dtype=bfloat16", "precision.compute=bfloat16"],
    "qlora": ["quantization.load_in_4bit=true", "precision.param_dtype=bfloat16", "precision.compute=bfloat16"],
}


def _overrides(args) -> list[str]:
    return [f"model.config.hidden_size={args.hidden}", f"model.config.intermediate_size={4 * args.hidden}",
            f"model.config.num_hidden_layers={args.layers}", f"model.config.num_attention_heads={args.hidden // 64}",
            f"model.config.num_key_value_heads={args.hidden // 64}", "model.config.max_position_embeddings=2048",
            "lora.r=16", "lora.alpha=32", "lora.target_modules=all-linear", *MODES.get(args.mode, MODES["qlora"])]


def _one(args) -> dict:
    import torch

    from elastic_ft.config import load_spec
    from elastic_ft.train import model as model_mod
    from elastic_ft.train import precision, quantization

    spec = load_spec(os.path.join(ROOT, "specs", "tiny-lora.yaml"), _overrides(args))
    tokenizer, model = model_mod.build(spec)
    base_bytes = quantization.weight_bytes(model.get_base_model()) - sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    built_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(ROOT, "data", "tiny-corpus.jsonl")) as f:
        texts = [" ".join(map(str, json.loads(line).values())) for line in f]
    text = " ".join(texts)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0][: args.batch * args.tokens]
    batch = ids.reshape(args.batch, args.tokens)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times, losses = [], []
    ctx = precision.autocast(spec.precision, torch.device("cpu"))
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with ctx:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    out = {"mode": args.mode, "params": sum(p.numel() for p in model.parameters()), "base_bytes": base_bytes,
           "peak_rss_after_build": built_peak, "step_s": statistics.median(times), "last_loss": losses[-1]}
    if args.mode == "qlora":
        from peft import prepare_model_for_kbit_training

        base = model_mod.build_base(spec.model, tokenizer, spec.seed, spec.precision, None, spec.quantization)
        before = quantization.weight_bytes(base)
        prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        out["prepare_adds_bytes"] = quantization.weight_bytes(base) - before
    return out


def _load_child(args) -> dict:
    """``save-bf16``: write the base to ``args.dir`` as a bfloat16 pretrained directory. ``load-bf16`` and
    ``load-4bit``: load it from there as the trainer loads a pretrained base, and measure it."""
    import torch

    from elastic_ft.config import load_spec
    from elastic_ft.train import model as model_mod
    from elastic_ft.train import quantization

    spec = load_spec(os.path.join(ROOT, "specs", "tiny-lora.yaml"), _overrides(args))
    if args.mode == "save-bf16":
        tokenizer = model_mod.build_tokenizer(spec.model)
        base = model_mod.build_base_model(spec.model, tokenizer, spec.seed, torch.float32).to(torch.bfloat16)
        base.save_pretrained(args.dir)
        tokenizer.save_pretrained(args.dir)
        return {"mode": args.mode}
    import bitsandbytes  # noqa: F401  (the libraries' own memory is not the base's)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    cfg = load_spec(os.path.join(ROOT, "specs", "tiny-lora.yaml"), [
        *_overrides(args), "model.config=null", f"model.name_or_path={args.dir}"]).model
    q = spec.quantization if args.mode == "load-4bit" else None
    tokenizer = model_mod.build_tokenizer(cfg)
    rss0, peak0 = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = model_mod.build_base(cfg, tokenizer, spec.seed, spec.precision, None, q)
    # A bfloat16 load keeps the file's memory-mapped pages until something reads them: read every tensor
    # once, as the first step would, so that both loads count what they hold.
    with torch.no_grad():
        for t in [*base.parameters(), *base.buffers()]:
            t.view(torch.uint8).sum() if t.is_contiguous() else t.sum()
    rss1, peak1 = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tensor_bytes = quantization.weight_bytes(base) + sum(b.numel() * b.element_size() for b in base.buffers())
    return {"mode": args.mode, "base_bytes": tensor_bytes, "rss_delta": rss1 - rss0,
            "peak_delta": max(0, peak1 - max(peak0, rss0)),
            "linear4bit": sum(quantization.is_4bit(m) for m in base.modules())}


def _rss() -> int:
    """The process's resident memory now (bytes), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


LLAMA_8B = {"vocab": 128256, "hidden": 4096, "kv": 1024, "mlp": 14336, "layers": 32}


def gpu_arithmetic(quantized: bool, chunk_tokens: int, tokens: int = 2048, r: int = 16) -> dict[str, float]:
    """Bytes per GPU process of an 8B spec (Llama-3.1-8B shapes; LoRA r 16 on all seven projections; micro-batch
    1 of ``tokens``; gradient checkpointing; the chunked loss over ``chunk_tokens``), computed, not measured.

    base: the decoder Linears at 2 bytes a weight, or nf4's 0.5 plus one 8-bit scale per 64 weights and one
    float32 scale per 256 scales (double quantization), and the untied embedding and output layer in
    bfloat16; adapters: 16 bytes a parameter (float32 weight, gradient, AdamW's two moments); activations:
    each layer's bf16 input kept, one layer's MLP (four tokens x mlp bf16 tensors) recomputed at a time, and
    for a 4-bit base one weight dequantized at a time (the largest, mlp x hidden in bf16); logits: one
    chunk's float32 logits and their gradient; a CUDA context of ~1.5 GB.
    """
    m = LLAMA_8B
    h, kv, mlp = m["hidden"], m["kv"], m["mlp"]
    decoder = m["layers"] * (h * h * 2 + h * kv * 2 + 3 * h * mlp)
    emb = 2 * m["vocab"] * h * 2
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256) if quantized else 2
    lora = m["layers"] * r * ((h + h) * 2 + (h + kv) * 2 + (h + mlp) * 3)
    parts = {"decoder": decoder * per_weight, "embeddings": emb, "adapters": 16 * lora,
             "layer_inputs": tokens * h * 2 * m["layers"], "recomputed_layer": tokens * mlp * 2 * 4,
             "dequantized_weight": h * mlp * 2 if quantized else 0, "logits": chunk_tokens * m["vocab"] * 4 * 2,
             "cuda_context": 1.5e9}
    parts["base"] = parts["decoder"] + parts["embeddings"]
    parts["activations"] = parts["layer_inputs"] + parts["recomputed_layer"] + parts["dequantized_weight"]
    parts["total"] = parts["base"] + parts["adapters"] + parts["activations"] + parts["logits"] + parts["cuda_context"]
    parts["lora_params"] = lora
    return parts


def _gpu_lines() -> list[str]:
    lines = []
    for name, quantized, chunk, gpu in (("llama-3.1-8b-lora-spot.yaml (bf16 base)", False, 1024, "40-48 GB GPU"),
                                        ("llama-3.1-8b-qlora-spot.yaml (4-bit base)", True, 512, "24 GB A10G/L4")):
        a = {k: v / 1e9 for k, v in gpu_arithmetic(quantized, chunk).items()}
        dequant = f" + {a['dequantized_weight']:.2f} dequantized weight" if quantized else ""
        lines.append(f"{name}, per GPU (computed, not measured): base {a['decoder']:.2f} + {a['embeddings']:.2f} "
                     f"= {a['base']:.2f} GB, adapters+grads+AdamW {a['adapters']:.2f} GB "
                     f"({a['lora_params'] * 1e3:.1f} M params), activations {a['layer_inputs']:.2f} layer inputs + "
                     f"{a['recomputed_layer']:.3f} one layer recomputed{dequant} = {a['activations']:.2f} GB, logits "
                     f"chunk ({chunk} tokens) {a['logits']:.2f} GB, CUDA context ~1.5 GB: ~{a['total']:.1f} GB "
                     f"of a {gpu}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--mode", choices=[*MODES, *LOAD_MODES], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(_load_child(args) if args.mode in LOAD_MODES else _one(args)))
        return

    def child(mode: str, *extra: str) -> dict:
        cmd = [sys.executable, __file__, "--mode", mode, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--steps", str(args.steps), "--tokens", str(args.tokens), "--batch", str(args.batch), *extra]
        env = {**os.environ, "PYTHONPATH": ROOT}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"bench/qlora.py --mode {mode} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    rows = [child(mode) for mode in MODES]
    with tempfile.TemporaryDirectory(prefix="bench-qlora-") as tmp:
        child("save-bf16", "--dir", tmp)
        loads = [child(mode, "--dir", tmp) for mode in ("load-bf16", "load-4bit")]
    ref = rows[0]
    print(f"model: {ref['params'] / 1e6:.0f} M parameters, {args.steps} steps of {args.batch} x {args.tokens} tokens")
    for r in rows:
        print(f"{r['mode']:10s} base {r['base_bytes'] / 2**20:8.1f} MiB ({r['base_bytes'] / ref['base_bytes']:.3f} of "
              f"fp32)  peak RSS after build {r['peak_rss_after_build'] / 2**20:8.1f} MiB  step {r['step_s']:.3f} s  "
              f"loss {r['last_loss']:.4f} ({r['last_loss'] - ref['last_loss']:+.4f} vs lora-fp32)")
        if "prepare_adds_bytes" in r:
            print(f"{'':10s} prepare_model_for_kbit_training would add {r['prepare_adds_bytes'] / 2**20:.1f} MiB "
                  f"(unquantized weights cast to float32)")
    print("the frozen base loaded from a bfloat16 pretrained directory, each in a fresh process:")
    bf16 = loads[0]
    for r in loads:
        print(f"{r['mode']:10s} base {r['base_bytes'] / 2**20:8.1f} MiB ({r['base_bytes'] / bf16['base_bytes']:.3f} of "
              f"bf16; {r['linear4bit']} Linear4bit)  RSS added by the load {r['rss_delta'] / 2**20:8.1f} MiB "
              f"(peak {r['peak_delta'] / 2**20:.1f} MiB more)")
    for line in _gpu_lines():
        print(line)


if __name__ == "__main__":
    main()
