"""Peak host memory and time of the loss through a large-vocabulary output layer: whole logits vs chunked.

Each mode runs in a fresh process (so its high-water mark is its own): random final hidden states
(requiring grad, as a decoder's are) through a bias-free ``Linear(hidden, vocab)`` output layer, the
summed token cross-entropy, and its backward, as :func:`elastic_ft.train.loss.summed_loss` does without
the decoder. Reported per mode: the peak resident memory above what the process held before the first
step (``ru_maxrss``; the layer's weight and its gradient count in both) and the median step time.

    python bench/chunked_loss.py [--vocab 128256] [--hidden 256] [--tokens 1024] [--chunk 256]
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one(args) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F

    from elastic_ft.train.loss import chunked_cross_entropy

    torch.manual_seed(0)
    layer = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    layer.weight.grad = torch.zeros_like(layer.weight)  # both modes hold it: not part of the difference
    before = _rss_bytes()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        if args.mode == "plain":
            loss = F.cross_entropy(layer(hidden).float(), targets, reduction="sum")
        else:
            loss = chunked_cross_entropy(layer, hidden, targets, args.chunk, contextlib.nullcontext)
        loss.backward()
        times.append(time.perf_counter() - t0)
        hidden.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_above_start_mb": (peak - before) / 2**20, "median_s": statistics.median(times),
            "loss": float(loss)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama 3's by default)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the micro-batch")
    p.add_argument("--chunk", type=int, default=256, help="model.loss_chunk_tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", choices=["plain", "chunked"], help=argparse.SUPPRESS)  # the child's
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(_one(args)))
        return 0
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.tokens} tokens, chunk {args.chunk}: the whole fp32 "
          f"logits are {logits_mb:.0f} MB, one chunk's {args.chunk * args.vocab * 4 / 2**20:.0f} MB")
    out = {}
    for mode in ("plain", "chunked"):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "tokens", "chunk", "repeats")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT])))
        r = out[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                                   .stdout.strip().splitlines()[-1])
        print(f"{mode:8}: peak {r['peak_above_start_mb']:7.0f} MB above start, median {r['median_s'] * 1e3:7.0f} "
              f"ms/step (forward+backward), loss {r['loss']:.4f}")
    pl, ch = out["plain"], out["chunked"]
    print(f"chunked/plain: peak memory {ch['peak_above_start_mb'] / pl['peak_above_start_mb']:.3f}, "
          f"time {ch['median_s'] / pl['median_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
