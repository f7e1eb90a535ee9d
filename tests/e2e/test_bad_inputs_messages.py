"""Bad inputs get one line naming the file and line, the argument or the field,
and what exists instead: data files, checkpoint URIs, export arguments, LoRA
target modules and torchx component arguments, through the real entry points."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from elastic_ft import cli, worker
from elastic_ft.config import DataConfig
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import byte_tokenizer
from tests.conftest import BIN, DEFAULT_SPEC, explain, run
from tests.e2e.conftest import train

GOOD = {"prompt": "2+2=", "response": " 4"}
BAD_LINE = 51


def one_error(capsys, prefix: str = "elastic_ft: error:") -> str:
    """The single error line of a failed command (no traceback, no second error)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    return lines[0]


def corpus(tmp_path, bad: bytes | None, name: str = "corpus.jsonl") -> str:
    """60 good prompt/response lines, line 51 replaced by ``bad`` (None: all good)."""
    lines = [json.dumps(GOOD).encode()] * 60
    if bad is not None:
        lines[BAD_LINE - 1] = bad
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def load(path: str, **fields):
    fields = fields or {"prompt_field": "prompt", "response_field": "response"}
    return data_mod.load(DataConfig(files=[path], max_length=16, **fields), byte_tokenizer())


@pytest.mark.parametrize("bad, expected", [
    (b'{"prompt": "2+2=", "response": " 4"', "not valid JSON"),
    (b'{"prompt": "2+2="}', "no field 'response' (data.response_field); the record has ['prompt']"),
    (b'{"prompt": "2+2=", "response": null}', "field 'response' is null, not text"),
    (b'["2+2=", " 4"]', "an array, not a JSON object"),
    (b'{"prompt": "2+2=", "response": " \xff4"}', "not UTF-8 text (byte 0xff"),
])
def test_a_bad_data_line_is_named_by_file_and_line(tmp_path, bad, expected):
    path = corpus(tmp_path, bad)
    with pytest.raises(data_mod.DataError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"data.files[0]:{BAD_LINE}: "), message
    assert expected in message and path in message, message


@pytest.mark.parametrize("content, expected", [(b"", "is empty"), (b"\n  \n\n", "has only blank lines")])
@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.txt"])
def test_an_empty_data_file_says_so(tmp_path, content, expected, name):
    good = corpus(tmp_path, None, "good.jsonl")
    path = tmp_path / name
    path.write_bytes(content)
    fields = {} if name.endswith(".txt") else {"prompt_field": "prompt", "response_field": "response"}
    with pytest.raises(data_mod.DataError) as info:
        data_mod.load(DataConfig(files=[good, str(path)], format="json" if "json" in name else "text",
                                 max_length=16, **fields), byte_tokenizer())
    assert str(info.value).startswith(f"data.files[1]: {str(path)!r} {expected}"), info.value


def test_a_field_no_record_has_is_the_spec_mistake(tmp_path):
    # A wrong field name is reported once, as before, not as a bad line 1.
    path = corpus(tmp_path, None)
    with pytest.raises(data_mod.DataError, match=r"data field 'text' is not in the data; it has columns"):
        load(path, text_field="text")


def test_a_json_array_file_names_the_record(tmp_path):
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps([GOOD, {"prompt": "x"}, GOOD]))
    with pytest.raises(data_mod.DataError, match=r"^data.files\[0\] record 2: no field 'response'"):
        load(str(path))
    # A good array (and a UTF-8 byte-order mark) still loads.
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([GOOD, GOOD]).encode())
    assert len(load(str(path))) == 2


def test_non_utf8_text_file_names_the_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"good line\n\xfe bad line\n")
    with pytest.raises(data_mod.DataError, match=r"^data.files\[0\]:2: not UTF-8 text \(byte 0xfe"):
        load(str(path), text_field="text")


def test_bad_data_line_through_the_worker_is_one_line(tmp_path, capsys):
    # Through the trainer: before, these bytes ended in a UnicodeDecodeError traceback.
    path = corpus(tmp_path, b'{"prompt": "\xff", "response": " 4"}')
    assert train(str(tmp_path / "runs"), "run", f"data.files=[{path}]") == 2
    assert f"data.files[0]:{BAD_LINE}: not UTF-8 text" in one_error(capsys)


@pytest.mark.parametrize("uri, expected", [
    ("s3://", "names no bucket"),
    ("s3:", "names no bucket"),
    ("s3:bucket/runs", "names no bucket"),
    ("s3://bucket?x=1", "query or fragment"),
    ("s3://bucket//runs", "empty path segment"),
    ("s3://bucket/../runs", "has a '..' path segment"),
    ("s3://bucket/runs/./x", "has a '.' path segment"),
    ("file://host/runs", "file:///absolute/path"),
])
def test_checkpoint_uri_is_quoted_as_typed(tmp_path, capsys, uri, expected):
    code = worker.main(["--spec", DEFAULT_SPEC, "--checkpoint_uri", uri, "--log_dir", str(tmp_path)])
    assert code == 2
    message = one_error(capsys)
    assert f"{uri!r}" in message and expected in message, message
    assert "tiny-lora" not in message, message  # the run id is not glued onto what the user typed


@pytest.fixture
def export_args(committed_run, tmp_path):
    """The committed run's URI, with its blobs gone: an export that loads anything fails on that instead."""
    root = str(tmp_path / "copy")
    shutil.copytree(committed_run, root)
    shutil.rmtree(os.path.join(root, "run", "blobs"))
    return f"file://{root}/run"


def test_export_out_that_is_a_file_fails_before_loading(export_args, tmp_path, capsys):
    out = tmp_path / "weights.bin"
    out.write_bytes(b"keep me")
    assert cli.main(["export", export_args, "--out", str(out)]) == 2
    message = one_error(capsys, "elastic-ft: error:")
    assert f"export --out {str(out)!r} is an existing file" in message, message
    assert out.read_bytes() == b"keep me"


def test_export_into_a_non_empty_directory_is_refused_unless_forced(export_args, committed_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text("an earlier export's")
    (out / "notes.txt").write_text("keep me")
    assert cli.main(["export", export_args, "--out", str(out)]) == 2
    message = one_error(capsys, "elastic-ft: error:")
    assert message == (f"elastic-ft: error: export --out {str(out)!r} is not empty (it holds adapter_config.json, "
                       f"notes.txt); name a new or empty directory, or add --force to write the export among "
                       f"those files (replacing any of the same name)")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "notes.txt"]
    assert (out / "adapter_config.json").read_text() == "an earlier export's"
    # --force writes the export among them
    assert cli.main(["export", f"file://{committed_run}/run", "--out", str(out), "--force"]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert (out / "notes.txt").read_text() == "keep me" and (out / "adapter_model.safetensors").is_file()


def test_export_step_that_does_not_exist_names_the_steps(export_args, tmp_path, capsys):
    assert cli.main(["export", export_args, "--out", str(tmp_path / "out"), "--step", "5"]) == 2
    message = one_error(capsys, "elastic-ft: error:")
    assert "export --step 5:" in message and "committed steps: 2, 4, 6" in message, message
    assert not (tmp_path / "out").exists()


def test_target_module_that_matches_nothing_names_the_modules(tmp_path, capsys):
    # peft raised only when no entry matched; with one good entry it trained without the typo's adapter.
    assert train(str(tmp_path), "run", "lora.target_modules=[q_proj,v_prj]", "steps=1") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("elastic_ft: error:") == 1, err
    assert "lora.target_modules: 'v_prj' matches no module of the model" in err, err
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err, err
    assert not os.path.exists(os.path.join(tmp_path, "run", "manifests")), "a run started anyway"


@pytest.mark.torchrun
def test_torchx_component_argument_error_has_no_traceback():
    proc = run([os.path.join(BIN, "torchx"), "run", "--dryrun", "-s", "local_cwd", "elastic_ft.train",
                "--nnodes", "3:2"], timeout=120)
    assert proc.returncode != 0, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert proc.stderr.strip().splitlines()[-1].strip() == "--nnodes '3:2': need 1 <= MIN <= MAX", explain(proc)


def test_null_in_a_parquet_column_names_the_record(tmp_path):
    import datasets

    path = str(tmp_path / "corpus.parquet")
    datasets.Dataset.from_dict({"text": ["good", None, "good"]}).to_parquet(path)
    with pytest.raises(data_mod.DataError, match=r"^data record 2: field 'text' is null, not text"):
        load(path, text_field="text")
