"""Q-LoRA against LoRA on CPU: the frozen base's memory, step time and loss, on a ~100M-parameter Llama built
from a config; and the GPU arithmetic of specs/llama-3.1-8b-qlora-spot.yaml beside it (computed, not measured).

Three modes, each in a fresh process (its memory high-water mark its own): ``lora-fp32`` (the base in
float32), ``lora-bf16`` (``precision.param_dtype/compute: bfloat16``) and ``qlora`` (the base 4-bit nf4 with
double quantization, the rest bfloat16). Each builds the model as the trainer does
(:func:`elastic_ft.train.model.build`), then trains LoRA r 16 on every decoder projection for ``--steps``
AdamW steps on the same batch of the tiny corpus. Reported per mode: the base's weight bytes (4-bit weights
with their scales), the process's peak resident memory after building, the median step time, and the last
loss against lora-fp32's. ``qlora`` also reports what PEFT's ``prepare_model_for_kbit_training`` would add
(it casts every unquantized weight to float32): the reason the trainer does not call it.

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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "lora-fp32": [],
    "lora-bf16": ["precision.param_dtype=bfloat16", "precision.compute=bfloat16"],
    "qlora": ["quantization.load_in_4bit=true", "precision.param_dtype=bfloat16", "precision.compute=bfloat16"],
}


def _overrides(args) -> list[str]:
    return [f"model.config.hidden_size={args.hidden}", f"model.config.intermediate_size={4 * args.hidden}",
            f"model.config.num_hidden_layers={args.layers}", f"model.config.num_attention_heads={args.hidden // 64}",
            f"model.config.num_key_value_heads={args.hidden // 64}", "model.config.max_position_embeddings=2048",
            "lora.r=16", "lora.alpha=32", "lora.target_modules=all-linear", *MODES[args.mode]]


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


def _gpu_arithmetic() -> list[str]:
    """The 8B Q-LoRA spec's memory per GPU (Llama-3.1-8B shapes; r 16 all-linear; 2048 tokens; chunk 512)."""
    emb = 128256 * 4096
    decoder = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    base = decoder * (0.5 + 1 / 64 + 4 / (64 * 256)) + 2 * emb * 2
    lora = 32 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    acts = 2048 * 4096 * 2 * 32 + 2048 * 14336 * 2 * 4 + 4096 * 14336 * 2
    logits = 512 * 128256 * 4 * 2
    total = base + 16 * lora + acts + logits + 1.5e9
    return [f"8B Q-LoRA spec per GPU (computed, not measured): base {base / 1e9:.2f} GB, adapters+grads+AdamW "
            f"{16 * lora / 1e9:.2f} GB ({lora / 1e6:.1f} M params), activations {acts / 1e9:.2f} GB, logits chunk "
            f"{logits / 1e9:.2f} GB, CUDA context ~1.5 GB: ~{total / 1e9:.1f} GB of a 24 GB A10G/L4"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(_one(args)))
        return
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--steps", str(args.steps), "--tokens", str(args.tokens), "--batch", str(args.batch)]
        env = {**os.environ, "PYTHONPATH": ROOT}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ref = rows[0]
    print(f"model: {ref['params'] / 1e6:.0f} M parameters, {args.steps} steps of {args.batch} x {args.tokens} tokens")
    for r in rows:
        print(f"{r['mode']:10s} base {r['base_bytes'] / 2**20:8.1f} MiB ({r['base_bytes'] / ref['base_bytes']:.3f} of "
              f"fp32)  peak RSS after build {r['peak_rss_after_build'] / 2**20:8.1f} MiB  step {r['step_s']:.3f} s  "
              f"loss {r['last_loss']:.4f} ({r['last_loss'] - ref['last_loss']:+.4f} vs lora-fp32)")
        if "prepare_adds_bytes" in r:
            print(f"{'':10s} prepare_model_for_kbit_training would add {r['prepare_adds_bytes'] / 2**20:.1f} MiB "
                  f"(unquantized weights cast to float32)")
    for line in _gpu_arithmetic():
        print(line)


if __name__ == "__main__":
    main()
