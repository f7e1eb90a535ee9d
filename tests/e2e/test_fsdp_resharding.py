"""An FSDP full fine-tune (specs/tiny-full-fsdp.yaml) whose world goes 2 -> 3 -> 1 ranks, against the same run
uninterrupted at world 2; and the sharded checkpoint exported as a model directory ``from_pretrained`` loads.

Each world is one torchrun job of the same command (the run id and store are the same, so a job resumes
where the last left): at world 2 rank 1 is SIGKILLed after step 3, at world 3 rank 2 after step 5, and a
job of one rank finishes. Saves are synchronous here so that each kill finds the previous even step
committed: every resume is then from a checkpoint written at another world size (2 -> 3 -> 1), loaded by
DCP's planner into the new world's shards.

constant_global keeps the global batch and LR at every world (9 samples: 5 and 4 per rank at world 2, in 2
and 1 micro-batches of at most 4, which FSDP runs in lockstep; 3 per rank at world 3; 9 in 3 micro-batches
at world 1), so the final weights must be the uninterrupted run's up to the order of float sums
(reduce-scatters over 2, 3 and 1 ranks): within ``WEIGHT_ATOL`` absolute (measured 1.2e-7 with 12 samples
per step, on weights up to 1.0 that the 8 steps move by 0.014 at least per tensor). ``grad_clip`` 0.5 is
below every step's norm here (2.4 to 5.5 at 12 samples), so a norm that were not global (a rank's
shards only) would clip differently at each world and change the weights by far more.

The interrupted run takes its loss 16 tokens at a time (``model.loss_chunk_tokens``, not part of the config
hash), the reference in one piece: the output layer is then called after the sharded root's forward has
returned, at each world, and must still give the same weights (measured 1.2e-7 apart at world 2).

DDP checkpoints' exports are tests/e2e/test_main_job.py::test_export_loads_with_peft_and_has_trained_lora
(LoRA adapter) and tests/e2e/test_models_and_data.py (full model); a sharded LoRA export is
tests/unit/test_sharded_training.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from elastic_ft.checkpoint.reader import load_newest
from elastic_ft.checkpoint.sharded import is_sharded, load_sharded_full
from elastic_ft.checkpoint.store import open_store
from elastic_ft.runevents.events import read_events
from elastic_ft.train.export import export
from elastic_ft.runevents.ledger import check_exactly_once, replay
from tests.conftest import REPO, explain, process_env, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # four torchrun jobs

FSDP_SPEC = os.path.join(REPO, "specs", "tiny-full-fsdp.yaml")
STEPS = 8
OVERRIDES = [f"steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.keep_last=null", "checkpoint.async_save=false",
             "logging.ledger=true", "logging.every_steps=1", "batch.global_batch=9", "batch.micro_batch=4",
             "optimizer.schedule=constant", "optimizer.warmup_steps=0", "optimizer.grad_clip=0.5"]
WEIGHT_ATOL = 2e-5
CHUNKED = "model.loss_chunk_tokens=16"


def job(root: str, run_id: str, nproc: int, kill: str | None = None, *extra: str):
    args = ["--spec", FSDP_SPEC, "--run_id", run_id, "--checkpoint_uri", f"file://{root}",
            "--log_dir", os.path.join(root, run_id, "logs"), *OVERRIDES, *extra]
    faults = {"ELASTIC_FT_FAULTS": kill} if kill else {}
    return torchrun(nproc, args, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **faults))


def final_weights(root: str, run_id: str) -> tuple[int, dict[str, torch.Tensor]]:
    store = open_store(f"file://{root}/{run_id}")
    loaded, skipped = load_newest(store, run_id)
    assert loaded is not None and not skipped
    assert is_sharded(loaded.manifest)
    return loaded.manifest.step, load_sharded_full(store, loaded.manifest)["model"]


def test_fsdp_run_reshards_over_worlds_2_3_1_and_exports(run_root, tmp_path):
    ref = job(run_root, "ref", 2)
    assert ref.returncode == 0, explain(ref)
    for nproc, kill in ((2, "kill:rank=1,step=3"), (3, "kill:rank=2,step=5")):
        killed = job(run_root, "run", nproc, kill, CHUNKED)
        assert killed.returncode != 0, f"the injected kill did not stop the world-{nproc} job\n{explain(killed)}"
    last = job(run_root, "run", 1, None, CHUNKED)
    assert last.returncode == 0, explain(last)

    events = read_events(os.path.join(run_root, "run", "logs", "events.jsonl"))
    starts = [e["world"] for e in events if e["event"] == "start"]
    resumes = [e["step"] for e in events if e["event"] == "resume_plan"]
    committed = {e["step"]: e["parts"] for e in events if e["event"] == "checkpoint_committed"}
    assert starts == [2, 3, 1] and resumes == [0, 2, 4], (starts, resumes)
    assert committed == {2: 2, 4: 3, 6: 1, 8: 1}, committed  # each resume read another world's shards
    # No sample lost or repeated: the steps the final model saw, each of 9 samples, each sample once.
    history = replay(events)
    assert sorted(history) == list(range(STEPS)) and all(len(v) == 9 for v in history.values())
    dataset_size = next(e["dataset_size"] for e in events if e["event"] == "start")
    assert check_exactly_once(history, dataset_size) == []

    (step, got), (ref_step, want) = final_weights(run_root, "run"), final_weights(run_root, "ref")
    assert step == ref_step == STEPS and sorted(got) == sorted(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= WEIGHT_ATOL, f"final weights differ from the uninterrupted run's by up to {worst:.3g}"

    # The sharded checkpoint of two ranks exports as one model directory that transformers loads.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    assert export(f"file://{run_root}/ref", str(out)) == {"step": STEPS, "out": str(out), "lora": False}
    model = AutoModelForCausalLM.from_pretrained(str(out))
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(params[name].detach(), tensor, rtol=0, atol=0, msg=name)
    ids = AutoTokenizer.from_pretrained(str(out))("What is 12 plus 30?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
