"""Q-LoRA across a change of world: the tiny job on a 4-bit base, run by torchrun at world 2 until rank 1 is
SIGKILLed after step 5, then resumed by the same command at world 1, against the same run uninterrupted.

The 4-bit weights are never checkpointed: the resumed worker quantizes the base again as it loads it, and
only because that gives the same bytes (tests/unit/test_qlora.py) does the resumed run continue on the
base its predecessor trained on. constant_global keeps the global batch and the LR at both worlds, so the
final adapters must be the uninterrupted run's up to the order of float sums: within ``WEIGHT_ATOL``, the
LoRA tests' tolerance (tests/unit/test_sharded_training.py), while the 6 steps move every B matrix by more
than 100 times it. The 4-bit layers compute in float32 here (``quantization.compute_dtype``): which samples
share a micro-batch depends on the world (each rank groups its share by length), and at the default
bfloat16 the other padded shapes round differently (measured: 2.1e-4 after 6 steps, a tenth of an AdamW
step at this lr), which would hide a real divergence of that size.
"""

from __future__ import annotations

import os

import pytest
import torch

from elastic_ft.checkpoint.reader import load_newest
from elastic_ft.checkpoint.store import open_store
from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun
from tests.e2e.conftest import train

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

STEPS = 6
WEIGHT_ATOL = 1e-5
OVERRIDES = ["quantization.load_in_4bit=true", "quantization.compute_dtype=float32", f"steps={STEPS}", "checkpoint.every_steps=2",
             "checkpoint.keep_last=null", "checkpoint.async_save=false", "logging.every_steps=1",
             "batch.global_batch=8", "batch.micro_batch=4", "optimizer.schedule=constant",
             "optimizer.warmup_steps=0"]


def final_adapters(root: str, run_id: str) -> tuple[int, dict[str, torch.Tensor]]:
    store = open_store(f"file://{root}/{run_id}")
    try:
        loaded, skipped = load_newest(store, run_id)
    finally:
        store.close()
    assert loaded is not None and not skipped
    return loaded.manifest.step, loaded.tensors["model"]


def test_qlora_killed_at_world_2_and_resumed_at_world_1_ends_with_the_uninterrupted_adapters(run_root):
    assert train(run_root, "ref", *OVERRIDES) == 0
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{run_root}",
            "--log_dir", os.path.join(run_root, "run", "logs"), *OVERRIDES]
    first = torchrun(2, args, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                              ELASTIC_FT_FAULTS="kill:rank=1,step=5"))
    assert first.returncode != 0, f"the injected kill did not stop the world-2 job\n{explain(first)}"
    assert train(run_root, "run", *OVERRIDES) == 0

    events = read_events(os.path.join(run_root, "run", "logs", "events.jsonl"))
    assert [e["world"] for e in events if e["event"] == "start"] == [2, 1]
    assert [e["step"] for e in events if e["event"] == "resume_plan"] == [0, 4]
    ref_step, ref = final_adapters(run_root, "ref")
    step, got = final_adapters(run_root, "run")
    assert step == ref_step == STEPS
    assert sorted(got) == sorted(ref) and all(".lora_" in n for n in got)
    for name, tensor in ref.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)
    # Not equal by standing still: every B matrix started at zero and moved far beyond the tolerance.
    assert min(float(t.abs().max()) for n, t in ref.items() if ".lora_B." in n) > 100 * WEIGHT_ATOL
