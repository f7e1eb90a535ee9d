"""Per-step cost of keeping each completed step in node-local memory (``checkpoint.keep_step_in_memory``).

One trainer (world 1, this process, as a torchrun worker would run it: ``TORCHELASTIC_RUN_ID`` is set so the
keeper is on) trains in alternating blocks with its keeper on and off (A B B A ..., so drift from other load
hits both alike), on the same model, data and steps. "On" is ``Trainer.step_once`` as the run does it: the
step, then the host copy of the trainable state into the free buffer and the hand-over to the writer thread
(sha256 and the write to ``/dev/shm`` run there, beside the next step). Reported per spec: the median step
time of each, their ratio, the paired per-block ratios (median, interquartile range), the state's size, and
the time ``keep`` waited for the writer in all, and the keep's own cost on the training thread (wall and
CPU time per step, and as a share of the step: robust to a loaded machine, where the ratios are not). Two specs: the tiny spec, and a larger LoRA (a wider,
deeper model with rank-64 adapters: ~2.5M trainable parameters, ~30 MB of state with AdamW's moments).

    python bench/kept_state.py [--steps 120] [--block 6] [--only tiny|large]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)

SPEC = os.path.join(ROOT, "specs", "tiny-lora.yaml")
LARGE = ["model.config.hidden_size=512", "model.config.intermediate_size=1408", "model.config.num_hidden_layers=4",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "lora.r=64", "lora.alpha=128",
         "batch.global_batch=16", "batch.micro_batch=8"]


def measure(name: str, overrides: list[str], steps: int, block: int, warmup: int) -> dict:
    from elastic_ft.config import load_spec
    from elastic_ft.train.loop import RunOptions, Trainer
    from elastic_ft.train.world import init_world

    tmp = tempfile.mkdtemp(prefix="kept-bench-")
    spec = load_spec(SPEC, ["steps=1000000", "checkpoint.every_steps=null", "checkpoint.save_final=false",
                            *overrides])
    trainer = Trainer(spec, RunOptions(run_id=f"kept-bench-{name}-{os.getpid()}", checkpoint_uri=f"file://{tmp}/c",
                                       log_dir=os.path.join(tmp, "logs")), init_world())
    keeper = trainer.peers.keeper
    assert keeper is not None, "the keeper is off: run with TORCHELASTIC_RUN_ID set (this script sets it)"
    times: dict[str, list[float]] = {"on": [], "off": []}
    # The keep itself, on the training thread: wall and this thread's CPU time (the CPU figure leaves out waits
    # for a core on a loaded machine, which swamp the step-time ratio there).
    keep_cost = {"wall": 0.0, "cpu": 0.0, "n": 0}
    real_keep = trainer._keep

    def timed_keep() -> None:
        w0, c0 = time.perf_counter(), time.thread_time()
        real_keep()
        keep_cost["wall"] += time.perf_counter() - w0
        keep_cost["cpu"] += time.thread_time() - c0
        keep_cost["n"] += 1

    trainer._keep = timed_keep
    blocks: dict[str, list[float]] = {"on": [], "off": []}

    def run(mode: str, n: int, record: bool) -> None:
        trainer.peers.keeper = keeper if mode == "on" else None
        t_block = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            trainer.step_once()
            if record:
                times[mode].append(time.perf_counter() - t0)
        if mode == "on":
            keeper.flush()  # the block's last write does not spill into the next block's steps
        if record:
            blocks[mode].append(time.perf_counter() - t_block)

    try:
        run("on", warmup, False)
        run("off", warmup, False)
        keeper.wait_s = 0.0
        keep_cost.update(wall=0.0, cpu=0.0, n=0)
        for b in range(max(1, steps // (2 * block))):
            for mode in (("on", "off") if b % 2 == 0 else ("off", "on")):
                run(mode, block, True)
        trainer.peers.keeper = keeper
        size = sum(t.numel() * t.element_size() for t in trainer.trainable.values())
        from elastic_ft.train.restore import optimizer_tensors

        size += sum(t.numel() * t.element_size()
                    for t in optimizer_tensors(trainer.optimizer, trainer.param_names).values())
        ratios = [a / b for a, b in zip(blocks["on"], blocks["off"])]
        return {"name": name, "on": statistics.median(times["on"]), "off": statistics.median(times["off"]),
                "ratios": ratios, "bytes": size, "wait_s": keeper.wait_s, "steps": len(times["on"]),
                "written": keeper.written_step, "failures": keeper.failures,
                "keep_ms": 1e3 * keep_cost["wall"] / max(1, keep_cost["n"]),
                "keep_cpu_ms": 1e3 * keep_cost["cpu"] / max(1, keep_cost["n"])}
    finally:
        trainer.peers.close(ended=True)
        trainer.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120, help="timed steps per spec, both modes together")
    p.add_argument("--block", type=int, default=6)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--only", choices=("tiny", "large"))
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "kept-bench")  # as under torchrun: the keeper is on
    logging.basicConfig(level=logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    cases = {"tiny": [], "large": LARGE}
    for name, overrides in cases.items():
        if args.only and name != args.only:
            continue
        r = measure(name, overrides, args.steps, args.block, args.warmup)
        q = statistics.quantiles(r["ratios"], n=4) if len(r["ratios"]) > 1 else [r["ratios"][0]] * 3
        print(f"{name}: state {r['bytes'] / 1e6:.2f} MB | step median {r['off'] * 1e3:.1f} ms without, "
              f"{r['on'] * 1e3:.1f} ms keeping | ratio of medians {r['on'] / r['off']:.4f} | per-block ratio "
              f"median {statistics.median(r['ratios']):.4f} (IQR {q[0]:.4f}..{q[2]:.4f}, {len(r['ratios'])} blocks) | "
              f"keep on the training thread {r['keep_ms']:.2f} ms wall, {r['keep_cpu_ms']:.2f} ms CPU per step "
              f"({r['keep_ms'] / (r['off'] * 1e3):.2%} of a step) | "
              f"keep waited for the writer {r['wait_s'] * 1e3:.1f} ms over {r['steps']} steps | "
              f"last written step {r['written']}, failed writes {r['failures']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
