"""s3:// in the spec: a tiny model directory fetched into the cache and loaded from it (once per node),
and the spec's URI checks, each naming its field in one line."""

from __future__ import annotations

import os

import pytest
import torch

from elastic_ft.config import ConfigError, spec_from_dict
from elastic_ft.train import model as model_mod
from tests.conftest import REPO

DATA = os.path.join(REPO, "data", "tiny-corpus.jsonl")


def _tiny_model_dir(path: str) -> dict[str, torch.Tensor]:
    """save_pretrained of a tiny Llama and the byte tokenizer into ``path``; the model's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = model_mod.byte_tokenizer()
    config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tokenizer),
                                  max_position_embeddings=32)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _spec(model_uri: str, cache_dir: str, **extra) -> object:
    raw = {
        "model": {"name_or_path": model_uri},
        "data": {"files": [DATA], "prompt_field": "prompt", "response_field": "response"},
        "lora": {"target_modules": ["q_proj"]},
        "steps": 1,
        "inputs": {"cache_dir": cache_dir},
        "checkpoint": {"s3": {"max_attempts": 3, "backoff_initial": 0.01, "backoff_max": 0.05}},
        **extra,
    }
    return spec_from_dict(raw)


def test_model_directory_from_s3_loads_the_uploaded_weights_once(remote, tmp_path):
    local = str(tmp_path / "tiny-model")
    weights = _tiny_model_dir(local)
    for name in sorted(os.listdir(local)):
        with open(os.path.join(local, name), "rb") as f:
            remote.put(f"models/tiny/{name}", f.read())
    spec = _spec(remote.uri("models/tiny/"), remote.cache_dir)
    assert spec.model.name_or_path == remote.uri("models/tiny/")  # the spec keeps the URI

    tokenizer, model = model_mod.build(spec)
    loaded = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
              for k, v in model.state_dict().items() if "lora_" not in k}
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert len(tokenizer) == len(model_mod.byte_tokenizer())
    files = len(os.listdir(local))
    assert remote.gets("models/tiny/") == files

    model_mod.build(spec)  # a restarted worker on the same node
    assert remote.gets("models/tiny/") == files, "the model was downloaded again"


def test_config_hash_does_not_depend_on_the_input_cache(tmp_path):
    a = _spec("s3://bucket/models/tiny/", str(tmp_path / "a"))
    b = _spec("s3://bucket/models/tiny/", str(tmp_path / "b"), )
    b.inputs.max_model_files = 7
    assert a.hash() == b.hash()


@pytest.mark.parametrize(("field", "value", "expect"), [
    ("data.files", ["s3://"], "names no valid bucket"),
    ("data.files", ["s3://bucket/dir/"], "names a prefix, not a file"),
    ("data.files", ["s3://bucket/a/../b.jsonl"], "'..' segment"),
    ("data.files", ["gs://bucket/b.jsonl"], "only s3:// URIs are fetched"),
    ("data.files", ["s3://bucket/b.jsonl?versionId=1"], "query or fragment"),
    ("model.name_or_path", "s3://bucket", "names a whole bucket"),
    ("model.name_or_path", "s3://bucket//m/", "empty, '.' or '..' segment"),
    ("model.tokenizer", "https://example.com/tok", "only s3:// URIs are fetched"),
])
def test_bad_uri_is_one_problem_naming_the_field(tmp_path, field, value, expect):
    override = {"data.files": {"data": {"files": value, "prompt_field": "prompt", "response_field": "response"}},
                "model.name_or_path": {"model": {"name_or_path": value}},
                "model.tokenizer": {"model": {"name_or_path": "s3://bucket/m/", "tokenizer": value}}}[field]
    with pytest.raises(ConfigError) as err:
        _spec("s3://bucket/models/tiny/", str(tmp_path), **override)
    problems = err.value.problems
    named = field + ("[0]" if field == "data.files" else "")
    assert [p for p in problems if p[0] == named] and len(problems) == 1, problems
    assert expect in problems[0][1] and "\n" not in problems[0][1]


def test_input_bounds_are_checked_by_the_spec(tmp_path):
    with pytest.raises(ConfigError) as err:
        _spec("s3://bucket/m/", str(tmp_path), inputs={"max_file_bytes": 0, "max_model_files": 10**7})
    assert {p[0] for p in err.value.problems} == {"inputs.max_file_bytes", "inputs.max_model_files"}


def test_local_paths_and_hub_names_are_left_alone(tmp_path):
    spec = _spec("org/some-model", str(tmp_path))
    assert spec.data.files == [DATA] and spec.model.name_or_path == "org/some-model"
