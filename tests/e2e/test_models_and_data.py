"""The spec's other model and data sources, through the real trainer in this
process: text/packing/parquet/plain-text data, a full fine-tune (lora: null)
exported as a whole model, and a base model loaded from a local directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic_ft.config import DataConfig
from elastic_ft.runevents.events import read_events
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import byte_tokenizer
from tests.conftest import DEFAULT_SPEC, cli, explain
from tests.e2e.conftest import train

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.", "Hello!"]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_text_field_samples_are_padded_and_masked(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": t} for t in TEXTS])
    tok = byte_tokenizer()
    d = data_mod.load(DataConfig(files=[path], text_field="body", max_length=16), tok)
    assert len(d) == 3
    # "Hello!" is 6 bytes + bos + eos = 8 tokens: 7 targets after the shift, padded to 8 (its own length).
    batch = d.batch([2])
    assert batch["attention_mask"][0].sum() == 8 and d.target_count([2]) == 7
    assert tok.decode(batch["input_ids"][0][1:7]) == "Hello!"


def test_prompt_response_masks_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "pr.jsonl", [{"q": "2+2=", "a": " 4"}])
    d = data_mod.load(DataConfig(files=[path], prompt_field="q", response_field="a", max_length=16), byte_tokenizer())
    labels = d.batch([0])["labels"][0]
    # bos + 4 prompt bytes are ignored; " 4" and eos are the targets.
    assert (labels[:5] == data_mod.IGNORE).all() and d.target_count([0]) == 3


def test_packing_keeps_samples_whole_in_rows(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS])
    d = data_mod.load(DataConfig(files=[path], packing=True, max_length=64), byte_tokenizer())
    # 46, 42 and 8 tokens (with bos and eos): best fit puts "Hello!" after the fox (18 free), not into the
    # jugs' row (22 free); no sample is cut, none is split between rows.
    assert len(d) == 2 and [s.tolist() for s in d.samples_of([0, 1])] == [[0, 2], [1]]
    batch = d.batch([0, 1])
    # Padded to 56 (the longest row, 54, to a multiple of 8): the padding restarts too, a sequence of its own.
    assert batch["position_ids"][0].tolist() == list(range(46)) + list(range(8)) + list(range(2))
    assert batch["labels"][0, 46] == data_mod.IGNORE  # the fox's last token is not trained to predict "Hello!"
    assert d.target_count([0, 1]) == 45 + 7 + 41 and "attention_mask" not in batch


def test_parquet_and_plain_text_files(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.txt").write_text("\n".join(TEXTS) + "\n")
    for name in ("d.parquet", "d.txt"):
        d = data_mod.load(DataConfig(files=[str(tmp_path / name)], max_length=64), byte_tokenizer())
        assert len(d) == 3, name


def test_missing_field_names_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "x"}])
    with pytest.raises(data_mod.DataError, match=r"data field 'text' is not in the data; it has columns \['body'\]"):
        data_mod.load(DataConfig(files=[path], max_length=16), byte_tokenizer())


@pytest.mark.subprocess
@pytest.mark.slow
def test_full_fine_tune_exports_a_whole_model_that_a_local_dir_spec_can_train(tmp_path):
    from transformers import AutoModelForCausalLM

    root = str(tmp_path / "runs")
    assert train(root, "full", "lora=null", "steps=3", "optimizer.lr=1e-2") == 0
    out = tmp_path / "full-model"
    proc = cli("export", f"file://{root}/full", "--out", str(out))
    assert proc.returncode == 0, explain(proc)
    assert "as a model" in proc.stdout
    tuned = AutoModelForCausalLM.from_pretrained(str(out))
    events = read_events(os.path.join(root, "full", "logs", "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "checkpoint_committed"] == [3]

    # The exported directory is a base model for the next job (model.name_or_path), LoRA on top.
    assert train(root, "on-local", f"model.name_or_path={out}", "model.config=null", "steps=2") == 0
    export2 = tmp_path / "adapter"
    proc = cli("export", f"file://{root}/on-local", "--out", str(export2))
    assert proc.returncode == 0, explain(proc)
    adapter_cfg = json.loads((export2 / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(out)
    # A full fine-tune changed every weight matrix it trained, not only adapters.
    from elastic_ft.config import load_spec
    from elastic_ft.train.model import build_base_model

    spec = load_spec(DEFAULT_SPEC)
    base = build_base_model(spec.model, byte_tokenizer(), spec.seed)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(dict(base.named_parameters())[name], dict(tuned.named_parameters())[name])


@pytest.mark.subprocess
def test_the_default_specs_data_loads_without_importing_datasets():
    import subprocess
    import sys

    code = ("import sys; from elastic_ft.config import load_spec; from elastic_ft.train import data; "
            "from elastic_ft.train.model import byte_tokenizer; "
            f"d = data.load(load_spec({DEFAULT_SPEC!r}, []).data, byte_tokenizer()); "
            "print(len(d), 'datasets' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["1024", "False"], done.stderr
