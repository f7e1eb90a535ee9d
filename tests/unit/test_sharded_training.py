"""``parallelism.strategy: fsdp`` in the real trainer, in this process: one rank on a real gloo group, so the
model is really ``fully_shard``-ed (DTensor parameters on a mesh of one), its checkpoints sharded (DCP).

What one rank can show: the sharded step computes what the replicated one does (full fine-tune, LoRA on
a sharded base, and Q-LoRA on a sharded 4-bit base), a sharded checkpoint resumes exactly, either strategy resumes the other's checkpoint, and
a sharded LoRA checkpoint exports to an adapter PeftModel loads. Resharding across worlds of 2, 3 and 1
ranks is tests/e2e/test_fsdp_resharding.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from elastic_ft.checkpoint.reader import load_newest
from elastic_ft.checkpoint.sharded import is_sharded, load_sharded_full
from elastic_ft.checkpoint.store import open_store
from elastic_ft.config import load_spec
from elastic_ft.runevents.events import read_events
from elastic_ft.train import loop, sharding
from tests.conftest import REPO
from tests.ports import free_port

FSDP_SPEC = os.path.join(REPO, "specs", "tiny-full-fsdp.yaml")
SHORT = ["batch.global_batch=8", "batch.micro_batch=4", "checkpoint.every_steps=3", "logging.every_steps=1",
         "optimizer.warmup_steps=0", "optimizer.schedule=constant", "optimizer.grad_clip=0.5"]
LORA = ["lora.r=4", "lora.target_modules=[q_proj,v_proj,lm_head]"]


@dataclasses.dataclass
class Done:
    losses: list[float]
    weights: dict[str, torch.Tensor]
    """The newest checkpoint's trainable weights, whole."""
    sharded: bool
    resumed_from: int
    sharded_model: bool
    evals: list[float]
    sharded_4bit: int
    """How many 4-bit (bitsandbytes) modules hold their packed weight as a DTensor shard."""


@pytest.fixture
def gloo_rank(monkeypatch):
    """Environment for a one-rank process group; each run gets its own port."""
    for name, value in dict(MASTER_ADDR="127.0.0.1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)  # init_world shares the host's cores out between local ranks


def run(mp, root, run_id: str, steps: int, *overrides: str) -> Done:
    mp.setenv("MASTER_PORT", str(free_port()))
    spec = load_spec(FSDP_SPEC, [*SHORT, f"steps={steps}", *overrides])
    seen = {}
    real_wrap = sharding.wrap

    def wrap(*args, **kwargs):
        seen["net"] = real_wrap(*args, **kwargs)
        return seen["net"]

    mp.setattr(sharding, "wrap", wrap)
    opts = loop.RunOptions(run_id=run_id, checkpoint_uri=f"file://{root}", log_dir=os.path.join(root, run_id, "logs"))
    loop.run(spec, opts)
    events = read_events(os.path.join(root, run_id, "logs", "events.jsonl"))
    store = open_store(f"file://{root}/{run_id}")
    loaded, _ = load_newest(store, run_id)
    weights = load_sharded_full(store, loaded.manifest)["model"] if is_sharded(loaded.manifest) \
        else loaded.tensors["model"]
    from torch.distributed.tensor import DTensor

    from elastic_ft.train.quantization import is_4bit

    return Done(losses=[e["loss"] for e in events if e["event"] == "step"], weights=weights,
                sharded=is_sharded(loaded.manifest), resumed_from=[e for e in events if e["event"] == "resume_plan"][-1]["step"],
                sharded_model=sharding.is_sharded(seen["net"]),
                evals=[e["loss"] for e in events if e["event"] == "eval"],
                sharded_4bit=sum(is_4bit(m) and isinstance(m.weight, DTensor) for m in seen["net"].modules()))


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_sharded_step_computes_what_the_replicated_one_does(gloo_rank, tmp_path, lora):
    extra = LORA if lora else []
    fsdp = run(gloo_rank, tmp_path, "fsdp", 4, *extra)
    ddp = run(gloo_rank, tmp_path, "ddp", 4, "parallelism.strategy=ddp", *extra)
    assert fsdp.sharded_model and not ddp.sharded_model
    assert fsdp.sharded and not ddp.sharded  # an fsdp run's checkpoints are DCP's, a ddp run's replicated
    assert len(fsdp.losses) == 4 and fsdp.losses == pytest.approx(ddp.losses, rel=1e-5, abs=0)
    assert_same_weights(fsdp.weights, ddp.weights, atol=1e-5)
    if lora:
        assert all(".lora_" in n for n in fsdp.weights)  # the frozen, sharded base is not saved


def test_a_sharded_4bit_base_trains_and_evaluates_as_the_replicated_one(gloo_rank, tmp_path):
    """Q-LoRA under fsdp: the 4-bit weights (stored as bfloat16) are sharded DTensors, each all-gathered
    weight finds its quantization state again, and an evaluation between steps leaves the next step as it
    was (bitsandbytes' CPU repacking, which would pair repacked scales with unrepacked bytes, is off); the
    checkpoint holds the adapters only, never the 4-bit weights."""
    q4 = ["quantization.load_in_4bit=true", *LORA, "optimizer.lr=6e-3", "data.eval_fraction=0.2",
          "eval.every_steps=2", "eval.max_samples=8"]
    fsdp = run(gloo_rank, tmp_path, "fsdp", 4, *q4)
    ddp = run(gloo_rank, tmp_path, "ddp", 4, "parallelism.strategy=ddp", *q4)
    assert fsdp.sharded_model and fsdp.sharded_4bit == 14 and ddp.sharded_4bit == 0  # 7 projections x 2 layers
    assert fsdp.losses[-1] < fsdp.losses[0] and fsdp.losses == pytest.approx(ddp.losses, rel=1e-5, abs=0)
    assert len(fsdp.evals) == 2 and fsdp.evals == pytest.approx(ddp.evals, rel=1e-5, abs=0)
    assert_same_weights(fsdp.weights, ddp.weights, atol=1e-5)
    assert fsdp.weights and all(".lora_" in n for n in fsdp.weights)


def test_the_chunked_loss_calls_the_output_layer_after_the_sharded_forward(gloo_rank, tmp_path):
    """``model.loss_chunk_tokens`` runs ``lm_head`` (here a LoRA target too) after the sharded root's forward
    returned: its weights must still be the gathered ones, and their gradients reach the shards."""
    whole = run(gloo_rank, tmp_path, "whole", 3, *LORA)
    chunked = run(gloo_rank, tmp_path, "chunked", 3, *LORA, "model.loss_chunk_tokens=16")
    assert chunked.sharded_model and chunked.losses == pytest.approx(whole.losses, rel=1e-5, abs=0)
    assert_same_weights(chunked.weights, whole.weights, atol=1e-5)


def test_a_run_resumes_from_its_own_or_the_other_strategys_checkpoint(gloo_rank, tmp_path):
    """3 steps, then on to 5 from the step-3 checkpoint: fsdp -> fsdp (DCP into the shards), ddp -> fsdp (whole
    tensors distributed over the shards), fsdp -> ddp (DCP into whole tensors); each as fsdp's 5 uninterrupted."""
    reference = run(gloo_rank, tmp_path, "ref", 5)
    for first, then in (("fsdp", "fsdp"), ("ddp", "fsdp"), ("fsdp", "ddp")):
        run_id = f"{first}-{then}"
        run(gloo_rank, tmp_path, run_id, 3, f"parallelism.strategy={first}")
        resumed = run(gloo_rank, tmp_path, run_id, 5, f"parallelism.strategy={then}")
        assert resumed.resumed_from == 3, run_id
        assert resumed.losses == pytest.approx(reference.losses, rel=1e-5, abs=0), run_id
        assert resumed.sharded == (then == "fsdp"), run_id
        assert_same_weights(resumed.weights, reference.weights, atol=1e-5)


def test_a_sharded_lora_checkpoint_exports_an_adapter_peft_loads(gloo_rank, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from elastic_ft.train.export import export

    done = run(gloo_rank, tmp_path, "lora", 3, *LORA)
    assert done.sharded
    out = tmp_path / "adapter"
    assert export(f"file://{tmp_path}/lora", str(out)) == {"step": 3, "out": str(out), "lora": True}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "base")), str(out))
    loaded = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert sorted(loaded) == sorted(done.weights)
    for name, tensor in done.weights.items():
        torch.testing.assert_close(loaded[name].detach(), tensor, rtol=0, atol=0, msg=name)
    assert any(t.abs().sum() > 0 for n, t in done.weights.items() if "lora_B" in n)  # trained, not the zero init


def test_the_hybrid_mesh_trains_and_resumes_as_the_flat_one(gloo_rank, tmp_path):
    """``shard_size``'s 2-D (replicate, shard) mesh, here of 1 x 1 (one rank: the same numbers as the 1-D mesh);
    parameters placed (Replicate, Shard(0)), and DCP's checkpoint of them resumes."""
    flat = run(gloo_rank, tmp_path, "flat", 4)
    gloo_rank.setattr(sharding, "mesh_shape", lambda world, n: ((1, 1), ("replicate", "shard")))
    placements = []
    real_shard = sharding.shard
    gloo_rank.setattr(sharding, "shard", lambda *a, **k: placements.append(
        next((m := real_shard(*a, **k)).parameters()).placements) or m)
    run(gloo_rank, tmp_path, "hybrid", 2, "parallelism.shard_size=1")
    hybrid = run(gloo_rank, tmp_path, "hybrid", 4, "parallelism.shard_size=1")
    assert [str(p) for p in placements] == ["(Replicate(), Shard(dim=0))"] * 2
    assert hybrid.resumed_from == 2 and hybrid.losses == pytest.approx(flat.losses, rel=1e-6, abs=0)
    assert_same_weights(hybrid.weights, flat.weights, atol=1e-6)
