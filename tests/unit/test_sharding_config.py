"""``parallelism``: the strategy's values, hybrid sharding's shard_size and the worlds it cannot shard, and
what the FSDP wrapping finds in a model (its decoder layers, the mixed-precision policy); pure logic."""

from __future__ import annotations

import pytest
import torch

from elastic_ft.config import ConfigError, ParallelismConfig, PrecisionConfig, load_spec
from elastic_ft.train import loop, sharding
from elastic_ft.train import model as model_mod
from elastic_ft.train.world import World
from tests.conftest import DEFAULT_SPEC, REPO

FSDP_SPEC = f"{REPO}/specs/tiny-full-fsdp.yaml"


def problems(*overrides: str, spec: str = DEFAULT_SPEC) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        load_spec(spec, list(overrides))
    return err.value.problems


def test_strategy_takes_ddp_and_fsdp_and_names_the_field_for_anything_else():
    assert load_spec(DEFAULT_SPEC, ["parallelism.strategy=ddp"]).parallelism.strategy == "ddp"
    assert load_spec(DEFAULT_SPEC, ["parallelism.strategy=fsdp"]).parallelism.strategy == "fsdp"
    assert load_spec(FSDP_SPEC).parallelism == ParallelismConfig(strategy="fsdp")
    assert problems("parallelism.strategy=zero3") == [("parallelism.strategy", "'zero3' is not one of 'ddp', 'fsdp'")]


def test_shard_size_is_for_fsdp_and_bounded():
    assert load_spec(FSDP_SPEC, ["parallelism.shard_size=2"]).parallelism.shard_size == 2
    (field, msg), = problems("parallelism.shard_size=2")  # the default spec is ddp
    assert field == "parallelism.shard_size" and "applies to parallelism.strategy fsdp only" in msg
    (field, msg), = problems("parallelism.shard_size=0", spec=FSDP_SPEC)
    assert field == "parallelism.shard_size" and "0" in msg


def test_the_strategy_does_not_change_the_config_hash():
    """Where the state lives is not what is trained: a run may resume under the other strategy as the same run."""
    assert load_spec(DEFAULT_SPEC, ["parallelism.strategy=fsdp"]).hash() == load_spec(DEFAULT_SPEC).hash()


@pytest.mark.parametrize(("shard_size", "world", "ok"), [
    (None, 3, True), (2, 4, True), (2, 2, True), (2, 3, False), (4, 2, False), (1, 5, True),
])
def test_a_world_of_whole_shard_groups_only(shard_size, world, ok):
    cfg = ParallelismConfig(strategy="fsdp", shard_size=shard_size)
    got = sharding.world_problem(cfg, world)
    assert (got is None) == ok, got
    if not ok:
        field, msg = got
        assert field == "parallelism.shard_size"
        assert f"{shard_size} does not divide the current world of {world} rank(s)" in msg and "null" in msg


def test_the_trainer_checks_the_world_at_every_start_before_any_work(tmp_path):
    """What a restart at a world of 3 prints for shard_size 2: one line naming the field (exit 2, as any spec error)."""
    spec = load_spec(FSDP_SPEC, ["parallelism.shard_size=2"])
    opts = loop.RunOptions(run_id="r", checkpoint_uri=f"file://{tmp_path}", log_dir=str(tmp_path / "logs"))
    with pytest.raises(ConfigError) as err:
        loop.Trainer(spec, opts, World(0, 3, 0, 3, torch.device("cpu")))
    assert [f for f, _ in err.value.problems] == ["parallelism.shard_size"]
    assert not (tmp_path / "logs").exists()  # refused before the run's files were opened


def test_a_model_to_be_sharded_is_loaded_into_host_memory_not_onto_the_device():
    """A pretrained base under fsdp must not land whole on a device it may not fit: fully_shard moves its
    shards there. ddp, and a single process (nothing to shard over), load straight onto the device; so does
    a 4-bit base under fsdp (quantized on the device, its scales with it, then sharded there)."""
    gpu = torch.device("cuda", 3)
    assert sharding.load_device(ParallelismConfig(strategy="fsdp"), gpu, distributed=True) is None
    assert sharding.load_device(ParallelismConfig(strategy="fsdp"), gpu, distributed=False) == gpu
    assert sharding.load_device(ParallelismConfig(strategy="ddp"), gpu, distributed=True) == gpu
    assert sharding.load_device(ParallelismConfig(strategy="fsdp"), gpu, distributed=True, quantized=True) == gpu


def test_mesh_shape_is_one_dimensional_or_replicate_by_shard():
    assert sharding.mesh_shape(4, None) == ((4,), ("shard",))
    assert sharding.mesh_shape(4, 4) == ((4,), ("shard",))
    assert sharding.mesh_shape(6, 2) == ((3, 2), ("replicate", "shard"))


def test_mixed_precision_gathers_in_the_compute_dtype_and_reduces_in_float32():
    bf16 = sharding.mixed_precision(PrecisionConfig(param_dtype="bfloat16", compute="bfloat16"))
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = sharding.mixed_precision(PrecisionConfig())
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, torch.float32)


def test_decoder_layers_are_found_through_peft_and_in_gpt2():
    _, lora = model_mod.build(load_spec(DEFAULT_SPEC))
    assert sharding.decoder_layers(lora) is lora.get_base_model().model.layers
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    assert sharding.decoder_layers(gpt2) is gpt2.transformer.h
    with pytest.raises(ValueError, match="no list of layers"):
        sharding.decoder_layers(torch.nn.Linear(2, 2))


def test_lockstep_pads_a_rank_to_the_busiest_ranks_micro_batches_at_weight_zero():
    assert sharding.lockstep([[1, 2, 3, 4], [5]], 2) == [([1, 2, 3, 4], 1.0), ([5], 1.0)]
    assert sharding.lockstep([[6, 7, 8, 9]], 2) == [([6, 7, 8, 9], 1.0), ([6, 7, 8, 9], 0.0)]


def test_lockstep_gives_a_rank_dealt_no_sample_zero_weight_work():
    """A rank beyond a constant_global batch (BatchPlan.idle_ranks) still runs its micro-batches, at weight 0."""
    assert sharding.lockstep([], 1, filler=[7]) == [([7], 0.0)]  # DDP: one, for the gradient all-reduce
    assert sharding.lockstep([], 2, filler=[7]) == [([7], 0.0), ([7], 0.0)]  # FSDP: as many as the busiest
    assert sharding.lockstep([[1]], 2, filler=[7]) == [([1], 1.0), ([1], 0.0)]  # the filler only when needed
    with pytest.raises(ValueError, match="filler"):
        sharding.lockstep([], 1)
