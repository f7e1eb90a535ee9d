"""Evaluation cost: seconds per evaluation against seconds per training step, on the demo spec.

In this process (world 1), the demo spec's model (``specs/tiny-lora.yaml``) and
corpus: the held-out side of ``data.eval_fraction`` (``--fraction``), evaluated by
:class:`~elastic_ft.train.evaluation.Evaluator` at several ``eval.max_samples``
(the notice poll between micro-batches included); against it, one training
step of the spec's global batch (forward and backward of every micro-batch and
the optimizer step, as the trainer does it, without the collectives of a world
of one). Medians of ``--repeats``. Also the split's cost at a million samples.

    python bench/eval.py [--fraction 0.1] [--samples 64,256,1024] [--repeats 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elastic_ft.config import load_spec  # noqa: E402
from elastic_ft.runevents.events import EventLog  # noqa: E402
from elastic_ft.spot.watcher import NoticeBoard  # noqa: E402
from elastic_ft.train import data as data_mod, heldout, loss as loss_mod, model as model_mod  # noqa: E402
from elastic_ft.train.evaluation import Evaluator  # noqa: E402
from elastic_ft.train.micro_batches import micro_batches  # noqa: E402
from elastic_ft.train.preemption import NoticePoll  # noqa: E402
from elastic_ft.train.world import World  # noqa: E402

SPEC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specs", "tiny-lora.yaml")


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--samples", default="64,256,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("ELASTIC_FT_INPUT_CACHE", tempfile.mkdtemp(prefix="bench-eval-"))
    spec = load_spec(SPEC)
    tok, model = model_mod.build(spec)
    model.to(device)
    store = data_mod.load(spec.data, tok)
    train, held = heldout.split(store, args.fraction, spec.seed)
    world = World(0, 1, 0, 1, device)
    events = EventLog(None)
    noauto = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    step_samples = list(range(spec.batch.global_batch))
    tokens = train.target_count(step_samples)

    def train_step() -> None:
        for chunk in micro_batches(step_samples, spec.batch.micro_batch):
            batch = data_mod.to_device(train.batch(chunk), device)
            (loss_mod.summed_loss(model, model, batch, chunk_tokens=None, autocast=noauto) / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step_s = median_s(train_step, args.repeats)
    print(f"device {device}; demo corpus {len(store)} samples, {len(held)} held out (eval_fraction {args.fraction}); "
          f"micro_batch {spec.batch.micro_batch}")
    print(f"{'eval samples':>13} {'s/eval':>9} {'ms/sample':>10} {'x train step':>13}")
    print(f"{'(train step)':>13} {step_s:>9.4f} {1e3 * step_s / len(step_samples):>10.3f} {1.0:>13.2f}  "
          f"({len(step_samples)} samples)")
    for n in [int(x) for x in args.samples.split(",")]:
        ev = Evaluator(held, every_steps=1, max_samples=n, micro_batch=spec.batch.micro_batch, world=world,
                       events=events, chunk_tokens=None, autocast=noauto)

        def evaluate() -> None:
            ev.done_step = None
            assert ev.run(1, model=model, forward=model, sharded=False, poll=NoticePoll(world, NoticeBoard()))

        s = median_s(evaluate, args.repeats)
        print(f"{ev.samples:>13} {s:>9.4f} {1e3 * s / ev.samples:>10.3f} {s / step_s:>13.2f}")
    split_s = median_s(lambda: heldout.held_out(1_000_000, args.fraction, spec.seed), args.repeats)
    print(f"split of 1,000,000 samples: {1e3 * split_s:.1f} ms; index arrays 8 MB")


if __name__ == "__main__":
    main()
