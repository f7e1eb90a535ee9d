"""Job spec loading and validation (elastic_ft.config)."""

import os

import pytest
import yaml

from elastic_ft.config import ConfigError, JobSpec, load_spec, spec_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "specs", "tiny-lora.yaml")


def raw_spec() -> dict:
    with open(SPEC) as f:
        return yaml.safe_load(f)


def load(raw: dict, overrides=()) -> JobSpec:
    return spec_from_dict(raw, overrides=overrides, base_dir=os.path.dirname(SPEC))


def problems_of(raw: dict, overrides=()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load(raw, overrides)
    return dict(info.value.problems)


def test_default_spec_loads():
    spec = load_spec(SPEC)
    assert spec.name == "tiny-lora"
    assert spec.seed == 1234
    assert spec.model.config["model_type"] == "llama"
    assert spec.model.name_or_path is None
    # relative to the spec file, not the working directory
    assert spec.data.files == [os.path.join(ROOT, "data", "tiny-corpus.jsonl")]
    assert (spec.data.prompt_field, spec.data.response_field, spec.data.max_length) == ("prompt", "response", 48)
    assert spec.lora is not None and spec.lora.r == 8 and "down_proj" in spec.lora.target_modules
    assert spec.optimizer.lr == pytest.approx(3e-3)
    assert spec.optimizer.schedule == "cosine"
    assert (spec.batch.global_batch, spec.batch.micro_batch, spec.batch.policy) == (32, 8, "constant_global")
    assert (spec.steps, spec.epochs) == (100, None)
    assert spec.checkpoint.every_steps == 20 and spec.checkpoint.keep_last == 3
    assert spec.optimizer.weight_decay == 0.0  # unset keys keep their defaults


def test_load_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.path.isfile(load_spec(SPEC).data.files[0])


def test_overrides():
    spec = load_spec(SPEC, ["optimizer.lr=1e-4", "steps=7", "batch.policy=scale_with_world",
                            "lora.target_modules=[q_proj]", "checkpoint.every_seconds=2.5"])
    assert spec.optimizer.lr == pytest.approx(1e-4) and isinstance(spec.optimizer.lr, float)
    assert spec.steps == 7
    assert spec.batch.policy == "scale_with_world"
    assert spec.lora.target_modules == ["q_proj"]
    assert spec.checkpoint.every_seconds == 2.5


def test_scientific_notation_without_dot_in_yaml():
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; the spec must still take it as a float.
    raw = raw_spec()
    raw["optimizer"]["lr"] = "2e-4"
    assert load(raw).optimizer.lr == pytest.approx(2e-4)
    raw["optimizer"]["lr"] = "fast"
    assert "optimizer.lr" in problems_of(raw)


def test_override_creates_nested_new_keys():
    raw = raw_spec()
    del raw["logging"]
    spec = load(raw, ["logging.ledger=true", "model.config.rope_theta=5000.0"])
    assert spec.logging.ledger is True
    assert spec.logging.every_steps == 1  # the rest of the new section keeps defaults
    assert spec.model.config["rope_theta"] == 5000.0
    assert "logging" not in raw  # the caller's mapping is not modified


def test_override_of_unknown_nested_key_is_reported():
    probs = problems_of(raw_spec(), ["optimizer.new_thing.x=1"])
    assert probs["optimizer.new_thing"].startswith("unknown key")


@pytest.mark.parametrize("bad,expected", [
    ("optimizer.lr", "optimizer.lr: override must look like field.path=value"),
    ("=3", "=3: override must look like field.path=value"),
    ("steps.inner=1", "steps.inner: cannot set a field inside 'steps', which is not a mapping"),
])
def test_bad_override_syntax(bad, expected):
    with pytest.raises(ConfigError) as info:
        load_spec(SPEC, [bad])
    assert expected in str(info.value)


def test_unknown_key_suggests_closest_name():
    raw = raw_spec()
    raw["optimiser"] = raw.pop("optimizer")
    raw["batch"]["global_bach"] = raw["batch"].pop("global_batch")
    probs = problems_of(raw)
    assert "did you mean 'optimizer'?" in probs["optimiser"]
    assert "did you mean 'global_batch'?" in probs["batch.global_bach"]


def test_unknown_key_without_close_match_lists_valid_keys():
    raw = raw_spec()
    raw["batch"]["zzzz"] = 1
    assert "valid keys: global_batch, micro_batch" in problems_of(raw)["batch.zzzz"]


def test_all_problems_in_one_error():
    raw = raw_spec()
    raw["optimizer"]["lr"] = -0.5
    raw["batch"]["micro_batch"] = 0
    raw["batch"]["policy"] = "constant"
    raw["seed"] = "abc"
    raw["optimiser"] = {}
    with pytest.raises(ConfigError) as info:
        load(raw)
    probs = dict(info.value.problems)
    assert set(probs) == {"optimizer.lr", "batch.micro_batch", "batch.policy", "seed", "optimiser"}
    assert "-0.5" in probs["optimizer.lr"]
    assert "got 0" in probs["batch.micro_batch"]
    assert "'constant'" in probs["batch.policy"] and "'constant_global'" in probs["batch.policy"]
    assert "must be int" in probs["seed"] and "'abc'" in probs["seed"]
    msg = str(info.value)
    assert "5 problem(s)" in msg
    for field in probs:
        assert f"  - {field}: " in msg


def test_bool_is_not_an_int():
    assert "must be int" in problems_of(raw_spec(), ["batch.global_batch=true"])["batch.global_batch"]


def test_steps_and_epochs_exclusive():
    raw = raw_spec()
    raw["epochs"] = 2
    assert "exactly one of steps and epochs" in problems_of(raw)["steps"]
    raw = raw_spec()
    del raw["steps"]
    assert "exactly one of steps and epochs" in problems_of(raw)["steps"]
    spec = load(raw, ["epochs=1.5"])
    assert (spec.steps, spec.epochs) == (None, 1.5)


def test_missing_data_file_is_named(tmp_path):
    raw = raw_spec()
    raw["data"]["files"] = ["../data/no-such-file.jsonl"]
    probs = problems_of(raw)
    assert "no-such-file.jsonl" in probs["data.files[0]"] and "does not exist" in probs["data.files[0]"]
    spec = spec_from_dict(raw, base_dir=os.path.dirname(SPEC), check_files=False)
    assert spec.data.files[0].endswith("no-such-file.jsonl")


def test_missing_spec_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec(os.path.join(ROOT, "specs", "nope.yaml"))


def test_hash_ignores_volatile_fields_but_not_training_ones():
    base = load(raw_spec()).hash()
    assert load(raw_spec(), ["logging.every_steps=3", "logging.ledger=true"]).hash() == base
    assert load(raw_spec(), ["checkpoint.every_steps=5", "checkpoint.keep_last=1"]).hash() == base
    assert load(raw_spec(), ["steps=500"]).hash() == base
    assert load(raw_spec(), ["optimizer.lr=1e-4"]).hash() != base
    assert load(raw_spec(), ["seed=1"]).hash() != base
    assert load(raw_spec(), ["batch.global_batch=16"]).hash() != base
