"""Step-time overhead of elastic_ft's trainer against a plain DDP + peft loop.

Both run in the same processes, on the same model object and DDP wrapper (the
trainer's), the same tokenized data and the same batches
(the cursor's global batch, dealt to ranks as the trainer deals it). The
baseline is what one would write by hand: DDP, AdamW, Hugging Face's mean loss
from ``labels=``, ``no_sync`` on all but the last micro-batch, gradient
clipping, no cross-rank metrics. The trainer's step is
``elastic_ft.train.loop.Trainer.step_once`` (LR schedule, global-token loss
normalisation, the token-weighted loss all-reduce every ``logging.every_steps``,
events and progress line).

The world is ``--world`` processes (default 2) started with
``torch.multiprocessing`` spawn, joined by gloo on 127.0.0.1, with cores/world torch threads each (as under
torchrun; 1 each for world 2 on a 2-core machine).
After a warm-up, steps are timed in alternating blocks (default: single
steps, trainer then baseline, then the other way round) so drift from other
load on the machine hits both alike. Reported: the median per-step time of
each, their ratio, the median of the paired per-block ratios (robust when
the machine's load swings during the run), and rank 0's CPU time per step
(which leaves out time spent waiting for a core on a busy machine).

    python bench/step_overhead.py [--steps 40] [--block 1] [--world 2] [--spec specs/tiny-lora.yaml]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.ports import free_port  # noqa: E402  (after the path set-up above)


class Baseline:
    """A plain DDP + peft training step over given per-rank sample indices.

    It drives the trainer's own model and DDP wrapper, with an optimizer of its
    own: two model objects built alike still differ by up to ~10% in step time
    on this machine (allocation and cache layout), which would swamp the loop
    overhead this benchmark measures. Only the loop code differs.
    """

    def __init__(self, spec, world, data, model, ddp) -> None:
        import torch

        self.model, self.ddp = model, ddp
        self.data, self.world, self.spec = data, world, spec
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = spec.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)

    def step(self, mine: list[int], micro_batch: int) -> float:
        import torch

        net = self.ddp or self.model
        chunks = [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]
        loss_val = 0.0
        for j, chunk in enumerate(chunks):
            last = j == len(chunks) - 1
            sync = contextlib.nullcontext() if (last or self.ddp is None) else self.ddp.no_sync()
            batch = {k: v.to(self.world.device) for k, v in self.data.batch(chunk).items()}
            with sync:
                loss = net(**batch).loss / len(chunks)
                loss.backward()
            loss_val += loss.item()
        if self.spec.optimizer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_val


def _worker(rank: int, args, port: int, tmp: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.world))
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices, per process
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    from elastic_ft.config import load_spec
    from elastic_ft.train.cursor import deal, take
    from elastic_ft.train.loop import RunOptions, Trainer
    from elastic_ft.train.world import init_world

    t_setup = time.monotonic()
    # spot.enabled=false: no IMDS polling or SIGTERM handler in the measured process (as before spot existed).
    spec = load_spec(args.spec, ["steps=1000000", "spot.enabled=false"] + list(args.overrides))
    world = init_world()  # gloo process group, torch threads = cores // processes
    trainer = Trainer(spec, RunOptions(run_id="bench", checkpoint_uri=f"file://{tmp}/ckpt",
                                       log_dir=os.path.join(tmp, "logs")), world)
    base = Baseline(spec, world, trainer.data, trainer.model, trainer.ddp)
    plan = trainer.plan
    cursor = [0]

    def baseline_step() -> None:
        positions = take(cursor[0], plan.global_batch, len(trainer.data), spec.seed)
        mine = [i for _, i in deal(positions, plan.per_rank)[world.rank]]
        base.step(mine, plan.micro_batch)
        cursor[0] += plan.global_batch

    def timed(fn, n: int, wall: list[float], cpu: list[float]) -> None:
        if world.distributed:
            dist.barrier()  # both ranks start the block together
        for _ in range(n):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)

    setup_s = time.monotonic() - t_setup
    steps = {"trainer": trainer.step_once, "baseline": baseline_step}
    for fn in steps.values():
        timed(fn, args.warmup, [], [])
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for b in range(max(1, args.steps // args.block)):
        # A B B A ...: each loop goes first half the time, so neither gains from the order.
        for name in (order if b % 2 == 0 else order[::-1]):
            timed(steps[name], args.block, wall[name], cpu[name])
    if world.is_leader:
        with open(result_path, "w") as f:
            import json

            json.dump({"trainer": wall["trainer"], "baseline": wall["baseline"], "trainer_cpu": cpu["trainer"],
                       "baseline_cpu": cpu["baseline"], "setup_s": setup_s, "plan": plan.to_dict(),
                       "threads": torch.get_num_threads()}, f)
    trainer.close()
    if world.distributed:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps of each loop (after warm-up)")
    p.add_argument("--block", type=int, default=1, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each loop first")
    p.add_argument("--world", type=int, default=2,
                   help="processes (gloo on 127.0.0.1); each gets cores/world torch threads, as under torchrun")
    p.add_argument("--spec", default=os.path.join(ROOT, "specs", "tiny-lora.yaml"))
    p.add_argument("overrides", nargs="*", help="spec overrides field.path=value")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="elastic-ft-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        t0 = time.monotonic()
        mp.spawn(_worker, args=(args, free_port(), tmp, result_path), nprocs=args.world, join=True)
        import json

        with open(result_path) as f:
            r = json.load(f)
    tr, bl = statistics.median(r["trainer"]) * 1e3, statistics.median(r["baseline"]) * 1e3
    plan = r["plan"]
    print(f"setup: world {args.world} (torch.multiprocessing spawn, gloo on 127.0.0.1, {r['threads']} thread(s) "
          f"per process), spec {os.path.relpath(args.spec)}, global_batch {plan['global_batch']}, "
          f"per_rank {plan['per_rank']}, micro_batch {plan['micro_batch']}")
    print(f"timed {len(r['trainer'])} steps of each in blocks of {args.block} after {args.warmup} warm-up steps "
          f"({time.monotonic() - t0:.0f}s in all, {r['setup_s']:.0f}s of it building model and data)")
    trc, blc = statistics.median(r["trainer_cpu"]) * 1e3, statistics.median(r["baseline_cpu"]) * 1e3
    print(f"cpu time of rank 0 (ignores time waiting for a core): trainer {trc:.2f} ms/step, "
          f"baseline {blc:.2f} ms/step, ratio {trc / blc:.3f}")
    print(f"trainer : median {tr:8.2f} ms/step (p10 {_pct(r['trainer'], 10):.2f}, p90 {_pct(r['trainer'], 90):.2f})")
    print(f"baseline: median {bl:8.2f} ms/step (p10 {_pct(r['baseline'], 10):.2f}, p90 {_pct(r['baseline'], 90):.2f})")
    k = args.block
    pairs = [sum(r["trainer"][i : i + k]) / sum(r["baseline"][i : i + k]) for i in range(0, len(r["trainer"]), k)]
    print(f"median of {len(pairs)} paired block ratios = {statistics.median(pairs):.3f}")
    print(f"ratio trainer/baseline = {tr / bl:.3f} (target <= 1.03)")
    return 0


def _pct(xs: list[float], q: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))] * 1e3


if __name__ == "__main__":
    sys.exit(main())
