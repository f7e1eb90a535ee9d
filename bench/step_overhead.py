"""Step-time overhead of elastic_ft's trainer against a plain DDP + peft loop.

Both run in the same processes, on the same model object and DDP wrapper (the
trainer's), the same tokenized data and the same batches
(the cursor's global batch, dealt to ranks as the trainer deals it). The
baseline is what one would write by hand: DDP, AdamW (the kernel the trainer picks), Hugging Face's mean loss
from ``labels=``, ``no_sync`` on all but the last micro-batch, gradient
clipping, no cross-rank metrics. The trainer's step is
``elastic_ft.train.loop.Trainer.step_once`` (LR schedule, global-token loss
normalisation, the token-weighted loss all-reduce every ``logging.every_steps``,
events and progress line) after the spot boundary (below).

The world is ``--world`` processes (default 2) started with
``torch.multiprocessing`` spawn, joined by gloo on 127.0.0.1, with cores/world torch threads each (as under
torchrun; 1 each for world 2 on a 2-core machine).
After a warm-up, steps are timed in alternating blocks (trainer then
baseline, then the other way round) so drift from other
load on the machine hits both alike. Reported: the median per-step time of
each, their ratio, the paired per-block ratios of wall time and of rank 0's
CPU time (which leaves out time spent waiting for a core on a busy machine),
each with its median, interquartile range and a bootstrap 95% interval of
the median (robust when the machine's load swings during the run).

``--hf`` then compares the trainer's step with Hugging Face's
``transformers.Trainer`` training the same model object on the same tokenized
data with the same global batch (micro-batches and accumulation), AdamW kernel,
schedule, clipping and logging cadence, no saving or reporting: its
``train()`` runs, and every ``--block`` of its steps a callback runs a block of
the trainer's steps, so the two alternate as above. A step of ``transformers.Trainer``
is timed from one ``on_step_end`` to the next, which covers its data loading and logging.

The trainer's step is what ``Trainer.run`` does per step: the spot boundary
(the ranks' notice agreement, where the checkout has one) and ``step_once``.
The script measures whatever ``elastic_ft`` is first on the path
(``PYTHONPATH=<checkout>``), so one statistic compares two checkouts, e.g.
the "before" commit run alternately with the current tree. ``--profile``
prints a cProfile of rank 0's trainer steps.

    python bench/step_overhead.py [--steps 200] [--block 5] [--world 2] [--profile] [--hf] [--spec specs/tiny-lora.yaml]
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
# Appended, not prepended: with PYTHONPATH=<another checkout> this same script measures that checkout's
# trainer (e.g. the "before" commit), so before and after are timed by one bench with one statistic.
sys.path.append(ROOT)

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
        try:  # the AdamW kernel the trainer picks (fused where the device has it): only the loop differs
            from elastic_ft.train.optim import implementation
            impl = implementation(self.params[0].device.type, True)
        except ImportError:  # a checkout from before the choice: torch's default, as its trainer
            impl = {}
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, **impl)

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


def _imports():
    """``init_world`` and the spec overrides of the checkout on the path (it moved; spot came later)."""
    try:
        from elastic_ft.train.world import init_world
    except ImportError:  # the "before" commit kept it in the loop module
        from elastic_ft.train.loop import init_world
    try:
        from elastic_ft.config import SpotConfig  # noqa: F401
    except ImportError:
        return init_world, []
    # spot.enabled=false: no IMDS polling or SIGTERM handler in the measured process (as before spot existed);
    # the per-step agreement still runs, as it does in every multi-rank run.
    return init_world, ["spot.enabled=false"]


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

    init_world, extra = _imports()
    t_setup = time.monotonic()
    spec = load_spec(args.spec, ["steps=1000000"] + extra + list(args.overrides))
    world = init_world()  # gloo process group, torch threads = cores // processes
    trainer = Trainer(spec, RunOptions(run_id="bench", checkpoint_uri=f"file://{tmp}/ckpt",
                                       log_dir=os.path.join(tmp, "logs")), world)
    # The trainer's DDP wrapper (its ``net``), or none on one process.
    base = Baseline(spec, world, trainer.data, trainer.model, trainer.net if trainer.net is not trainer.model else None)
    plan = trainer.plan
    cursor = [0]
    boundary = getattr(getattr(trainer, "preemption", None), "at_boundary", None)

    def trainer_step() -> None:
        # What Trainer.run does around each step (fault injection and the due-check aside).
        if boundary is not None:
            boundary(trainer)
        trainer.step_once()

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
    steps = {"trainer": trainer_step, "baseline": baseline_step}
    for fn in steps.values():
        timed(fn, args.warmup, [], [])
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    prof = _profiler(args.profile and world.is_leader)
    for b in range(max(1, args.steps // args.block)):
        # A B B A ...: each loop goes first half the time, so neither gains from the order.
        for name in (order if b % 2 == 0 else order[::-1]):
            with prof(name):
                timed(steps[name], args.block, wall[name], cpu[name])
    hf: dict[str, list[float]] = {}
    if args.hf:
        hf = _against_hf(spec, trainer, lambda: timed(trainer_step, args.block, hf["trainer"], hf["trainer_cpu"]),
                         args, tmp, hf)
    if world.is_leader:
        with open(result_path, "w") as f:
            import json

            json.dump({"trainer": wall["trainer"], "baseline": wall["baseline"], "trainer_cpu": cpu["trainer"],
                       "baseline_cpu": cpu["baseline"], "setup_s": setup_s, "plan": plan.to_dict(),
                       "threads": torch.get_num_threads(), "hf": hf}, f)
    prof.report()
    trainer.close()
    if world.distributed:
        dist.destroy_process_group()


class _Indices:
    """The dataset ``transformers.Trainer`` samples: sample indices, batched by the trainer's own ``data.batch``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _against_hf(spec, trainer, trainer_block, args, tmp: str, out: dict) -> dict:
    """``transformers.Trainer`` on the trainer's model, data and batch, a block of the trainer's steps after
    each block of its own (a callback): the step times of both, into ``out``."""
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    out.update(trainer=[], trainer_cpu=[], hf=[], hf_cpu=[])
    state = {"n": 0, "last": None}
    plan = trainer.plan
    forwards: list[int] = []  # the micro-batch sizes of transformers.Trainer's last step: the same work as ours
    hook = trainer.model.register_forward_pre_hook(
        lambda _m, _a, kw: forwards.append(kw["input_ids"].shape[0]), with_kwargs=True)

    class Interleave(TrainerCallback):
        def on_step_end(self, _args, _state, control, **_kw):
            now, cpu_now = time.perf_counter(), time.process_time()
            if forwards != [plan.micro_batch] * plan.micro_steps[0]:
                raise SystemExit(f"transformers.Trainer's step ran micro-batches {forwards}, not the trainer's")
            state["n"] += 1
            timed_n = state["n"] - args.warmup
            if timed_n > 0:
                out["hf"].append(now - state["last"][0])
                out["hf_cpu"].append(cpu_now - state["last"][1])
                if timed_n % args.block == 0:
                    trainer_block()
            forwards.clear()
            state["last"] = (time.perf_counter(), time.process_time())
            return control

    o = spec.optimizer
    from elastic_ft.train.optim import implementation

    fused = implementation(trainer.world.device.type, True).get("fused", False)
    hf_args = TrainingArguments(
        output_dir=os.path.join(tmp, "hf"), per_device_train_batch_size=plan.micro_batch,
        gradient_accumulation_steps=plan.micro_steps[0],
        max_steps=args.warmup + args.steps, learning_rate=plan.lr, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps, max_grad_norm=o.grad_clip or 0.0,
        lr_scheduler_type=o.schedule, warmup_steps=o.warmup_steps, optim="adamw_torch_fused" if fused else "adamw_torch",
        logging_strategy="steps", logging_steps=spec.logging.every_steps, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=spec.seed, use_cpu=trainer.world.device.type == "cpu",
        remove_unused_columns=False,
        # Its DDP (under torchrun it wraps the model in one of its own, over the same process group) as the
        # trainer's: its default for a model that is not a PreTrainedModel (a PeftModel) would search the graph
        # for unused parameters every step.
        ddp_find_unused_parameters=False,
    )
    if plan.micro_batch * plan.micro_steps[0] * plan.world != plan.global_batch:
        raise SystemExit(f"--hf needs a global batch ({plan.global_batch}) that is a multiple of micro-batch x world "
                         f"({plan.micro_batch} x {plan.world}): transformers.Trainer's micro-batches are all alike")
    hf = transformers.Trainer(model=trainer.model, args=hf_args, train_dataset=_Indices(len(trainer.data)),
                              data_collator=trainer.data.batch, callbacks=[Interleave()])
    hf.train()
    hook.remove()
    out["version"] = transformers.__version__
    return out


class _profiler:
    """cProfile of rank 0's trainer blocks only (``--profile``): where the trainer's extra time goes."""

    def __init__(self, enabled: bool) -> None:
        import cProfile

        self.prof = cProfile.Profile() if enabled else None

    @contextlib.contextmanager
    def __call__(self, name: str):
        on = self.prof is not None and name == "trainer"
        if on:
            self.prof.enable()
        try:
            yield
        finally:
            if on:
                self.prof.disable()

    def report(self) -> None:
        if self.prof is not None:
            import pstats

            pstats.Stats(self.prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)


def spread(xs: list[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float, float, float]:
    """Median, interquartile range and a bootstrap 95% confidence interval of the median of ``xs``.

    The resampling uses a fixed seed, so one set of timings always prints the same interval.
    """
    import random

    rng = random.Random(seed)
    q1, _, q3 = statistics.quantiles(xs, n=4)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return statistics.median(xs), q1, q3, meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps of each loop (after warm-up)")
    p.add_argument("--block", type=int, default=5, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each loop first")
    p.add_argument("--world", type=int, default=2,
                   help="processes (gloo on 127.0.0.1); each gets cores/world torch threads, as under torchrun")
    p.add_argument("--spec", default=os.path.join(ROOT, "specs", "tiny-lora.yaml"))
    p.add_argument("--profile", action="store_true", help="print a cProfile of rank 0's trainer steps")
    p.add_argument("--hf", action="store_true",
                   help="then compare with transformers.Trainer on the same model, data and batch")
    p.add_argument("overrides", nargs="*", help="spec overrides field.path=value")
    args = p.parse_args(argv)
    if args.steps < 4 * args.block:
        p.error(f"--steps ({args.steps}) must be at least 4 blocks of --block ({args.block}) for a spread")

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="elastic-ft-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        t0 = time.monotonic()
        mp.spawn(_worker, args=(args, free_port(), tmp, result_path), nprocs=args.world, join=True)
        import json

        with open(result_path) as f:
            r = json.load(f)
    import elastic_ft

    tr, bl = statistics.median(r["trainer"]) * 1e3, statistics.median(r["baseline"]) * 1e3
    plan = r["plan"]
    print(f"code: {os.path.dirname(os.path.dirname(os.path.abspath(elastic_ft.__file__)))}")
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
    for what, t, b in (("wall", "trainer", "baseline"), ("rank-0 cpu", "trainer_cpu", "baseline_cpu")):
        med, q1, q3, lo, hi = spread(_block_ratios(r[t], r[b], args.block))
        print(f"paired block ratio, {what} (trainer/baseline, {len(r[t]) // args.block} blocks): median {med:.3f}, "
              f"IQR {q1:.3f}-{q3:.3f}, bootstrap 95% CI of the median {lo:.3f}-{hi:.3f}")
    print(f"ratio trainer/baseline = {tr / bl:.3f} (target <= 1.03)")
    if r["hf"]:
        _print_hf(r["hf"], args.block)
    return 0


def _print_hf(h: dict, block: int) -> None:
    tr, hf = statistics.median(h["trainer"]) * 1e3, statistics.median(h["hf"]) * 1e3
    print(f"against transformers.Trainer {h['version']} ({len(h['hf'])} steps of each, alternating blocks of {block}):")
    print(f"trainer             : median {tr:8.2f} ms/step (p10 {_pct(h['trainer'], 10):.2f}, "
          f"p90 {_pct(h['trainer'], 90):.2f})")
    print(f"transformers.Trainer: median {hf:8.2f} ms/step (p10 {_pct(h['hf'], 10):.2f}, p90 {_pct(h['hf'], 90):.2f})")
    for what, t, b in (("wall", "trainer", "hf"), ("rank-0 cpu", "trainer_cpu", "hf_cpu")):
        med, q1, q3, lo, hi = spread(_block_ratios(h[t], h[b], block))
        print(f"paired block ratio, {what} (trainer/transformers.Trainer, {len(h[t]) // block} blocks): median "
              f"{med:.3f}, IQR {q1:.3f}-{q3:.3f}, bootstrap 95% CI of the median {lo:.3f}-{hi:.3f}")
    print(f"ratio trainer/transformers.Trainer = {tr / hf:.3f} (target <= 1.00)")


def _block_ratios(trainer: list[float], baseline: list[float], k: int) -> list[float]:
    """Trainer over baseline time of each pair of blocks of ``k`` steps (timed back to back)."""
    return [sum(trainer[i : i + k]) / sum(baseline[i : i + k]) for i in range(0, len(trainer), k)]


def _pct(xs: list[float], q: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))] * 1e3


if __name__ == "__main__":
    sys.exit(main())
