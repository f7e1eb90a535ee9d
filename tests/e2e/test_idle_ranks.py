"""A node joins a ``constant_global`` run until the world is larger than the global batch: the run goes on.

The 8B spec's case (``global_batch: 32`` on 8 nodes of 8 GPUs) in small: 2 samples per step. A torchrun job
of one rank trains and commits step 2, then is SIGKILLed at step 3 (a node joining makes torchrun restart
every worker the same way); the same command then resumes at world 3, where one rank gets no sample. It
used to raise ``BatchPlanError`` there, and every rank exited 2: the join ended the run.

Now the third rank sits each step out (one zero-weight micro-batch, so it joins DDP's gradient
all-reduce with zero gradients), and the run must be the one an uninterrupted run at world 1 trains: the
same samples (each once, the ledger shows it), the same losses, the same weights up to the order of float
sums. AdamW runs with a large epsilon and no clipping, so that its update follows the gradient's size
(with the defaults it normalises a wrongly scaled gradient away). Measured: the losses equal to the 6
digits the events keep, the weights within 9.3e-10; with the gradient scaled as if the idle rank were not
there (world 2 in the loss scale), 1.4e-3 and 1.2e-3 apart. The tolerances, 1e-5 and 1e-6, lie between.
"""

from __future__ import annotations

import os

import pytest
import torch

from elastic_ft import worker
from elastic_ft.checkpoint.reader import load_newest
from elastic_ft.checkpoint.sharded import is_sharded, load_sharded_full
from elastic_ft.checkpoint.store import open_store
from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from tests.conftest import DEFAULT_SPEC, REPO, explain, process_env, torchrun
from tests.e2e.conftest import train

pytestmark = [pytest.mark.torchrun, pytest.mark.slow]  # torchrun jobs of up to three ranks

STEPS = 6
OVERRIDES = [f"steps={STEPS}", "batch.global_batch=2", "batch.micro_batch=1", "checkpoint.every_steps=2",
             "checkpoint.keep_last=null", "checkpoint.async_save=false", "logging.ledger=true",
             "logging.every_steps=1", "optimizer.schedule=constant", "optimizer.warmup_steps=0",
             # AdamW with a large epsilon and no clipping: the update follows the gradient's size, so a
             # gradient scaled wrongly for the idle rank (e.g. averaged over 2 ranks, not 3) would show.
             "optimizer.eps=1.0", "optimizer.grad_clip=null"]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6


def job(root: str, nproc: int, **env: str):
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{root}",
            "--log_dir", os.path.join(root, "run", "logs"), *OVERRIDES]
    return torchrun(nproc, args, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env))


def final(root: str, run_id: str) -> tuple[int, dict[str, torch.Tensor]]:
    loaded, skipped = load_newest(open_store(f"file://{root}/{run_id}"), run_id)
    assert loaded is not None and not skipped
    return loaded.manifest.step, loaded.tensors["model"]


def test_a_world_larger_than_the_global_batch_trains_what_a_world_that_fits_does(run_root):
    first = job(run_root, 1, ELASTIC_FT_FAULTS="kill:rank=0,step=3")
    assert first.returncode != 0, f"the injected kill did not stop the world-1 job\n{explain(first)}"
    joined = job(run_root, 3)
    assert joined.returncode == 0, explain(joined)
    assert "1 of 3 rank(s) idle each step" in joined.stderr + joined.stdout, explain(joined)
    assert train(run_root, "ref", *OVERRIDES) == 0

    events = read_events(os.path.join(run_root, "run", "logs", "events.jsonl"))
    assert [e["world"] for e in events if e["event"] == "start"] == [1, 3]
    resumed = [e for e in events if e["event"] == "resume_plan"][-1]
    assert resumed["step"] == 2, resumed
    (rescale,) = [e for e in events if e["event"] == "rescale"]
    assert rescale["idle_ranks"] == 1 and rescale["new"]["per_rank"] == [1, 1, 0], rescale
    assert (rescale["old"]["world"], rescale["new"]["world"]) == (1, 3)

    # The samples: every step of the final history took the global batch, each sample at most once, and
    # the idle rank none; the same steps as the reference run's.
    history = replay(events)
    ref_events = read_events(os.path.join(run_root, "ref", "logs", "events.jsonl"))
    assert history == replay(ref_events) and sorted(history) == list(range(STEPS))
    assert all(len(history[s]) == 2 for s in history)
    dataset_size = next(e["dataset_size"] for e in events if e["event"] == "start")
    assert check_exactly_once(history, dataset_size) == []
    after = events[events.index(resumed):]
    idle_steps = [e for e in after if e["event"] == "step"]
    assert [e["step"] for e in idle_steps] == list(range(3, STEPS + 1))
    dealt = [e["samples"] for e in after if e["event"] == "ledger"]
    assert len(dealt) == STEPS - 2 and all(len(d) == 3 and d[2] == [] for d in dealt), dealt  # rank 2: nothing

    # The losses of the steps trained at world 3 and the final weights: the world-1 run's.
    ref_loss = {e["step"]: e["loss"] for e in ref_events if e["event"] == "step"}
    loss_rel = max(abs(e["loss"] / ref_loss[e["step"]] - 1) for e in idle_steps)
    (step, got), (ref_step, want) = final(run_root, "run"), final(run_root, "ref")
    assert step == ref_step == STEPS and sorted(got) == sorted(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    print(f"world 3 with 1 idle rank against world 1: losses within {loss_rel:.3g} relative, "
          f"weights within {worst:.3g}")
    assert loss_rel <= LOSS_RTOL, f"the losses at world 3 differ from the world-1 run's by {loss_rel:.3g} relative"
    assert worst <= WEIGHT_ATOL, f"final weights differ from the world-1 run's by up to {worst:.3g}"


FSDP_SPEC = os.path.join(REPO, "specs", "tiny-full-fsdp.yaml")
FSDP_STEPS = 4
FSDP_OVERRIDES = [f"steps={FSDP_STEPS}", "batch.global_batch=1", "batch.micro_batch=1", "checkpoint.every_steps=4",
                  "logging.ledger=true", "logging.every_steps=1", "optimizer.schedule=constant",
                  "optimizer.warmup_steps=0", "optimizer.eps=1.0", "optimizer.grad_clip=null"]


def test_under_fsdp_the_idle_rank_keeps_the_lockstep_at_zero_weight(run_root):
    """FSDP all-gathers in every forward: the rank dealt nothing runs the busiest rank's micro-batch count
    on a filler sample at weight 0 (``sharding.lockstep``). World 2 with one sample per step against the
    same run on one process (the model whole): the same samples, losses and weights."""
    def args(run_id: str) -> list[str]:
        return ["--spec", FSDP_SPEC, "--run_id", run_id, "--checkpoint_uri", f"file://{run_root}",
                "--log_dir", os.path.join(run_root, run_id, "logs"), *FSDP_OVERRIDES]

    proc = torchrun(2, args("run"), env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert proc.returncode == 0, explain(proc)
    assert worker.main(args("ref")) == 0
    events, ref_events = (read_events(os.path.join(run_root, r, "logs", "events.jsonl")) for r in ("run", "ref"))
    start = next(e for e in events if e["event"] == "start")
    assert start["world"] == 2 and start["batch_plan"]["idle_ranks"] == 1
    assert replay(events) == replay(ref_events) and sorted(replay(events)) == list(range(FSDP_STEPS))
    assert all(e["samples"][1] == [] for e in events if e["event"] == "ledger")
    losses, ref_losses = ({e["step"]: e["loss"] for e in evs if e["event"] == "step"} for evs in (events, ref_events))
    assert sorted(losses) == sorted(ref_losses) == list(range(1, FSDP_STEPS + 1))
    assert [losses[s] for s in sorted(losses)] == pytest.approx([ref_losses[s] for s in sorted(losses)], rel=LOSS_RTOL)
    weights = {}
    for run_id in ("run", "ref"):
        store = open_store(f"file://{run_root}/{run_id}")
        loaded, _ = load_newest(store, run_id)
        assert loaded is not None and loaded.manifest.step == FSDP_STEPS and is_sharded(loaded.manifest)
        weights[run_id] = load_sharded_full(store, loaded.manifest)["model"]
    worst = max((weights["run"][n] - weights["ref"][n]).abs().max().item() for n in weights["ref"])
    print(f"fsdp world 2 with 1 idle rank against one process: weights within {worst:.3g}")
    assert worst <= WEIGHT_ATOL, f"final weights differ from the one-process run's by up to {worst:.3g}"
