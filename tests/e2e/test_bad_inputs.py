"""Bad inputs: one clear error naming the field or object, and no committed
checkpoint touched (every file of the run hashes the same afterwards)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from elastic_ft import worker
from elastic_ft.checkpoint.manifest import manifest_key
from tests.conftest import BIN, DEFAULT_SPEC, REPO, cli, explain, run, tree_digest
from tests.e2e.conftest import train


@pytest.fixture
def guarded(committed_run, tmp_path, capsys):
    """A copy of a committed run; after the test, proof that none of its bytes changed."""
    root = str(tmp_path / "guarded")
    shutil.copytree(committed_run, root)
    before = tree_digest(os.path.join(root, "run", "manifests")) | tree_digest(os.path.join(root, "run", "blobs"))
    yield root
    after = tree_digest(os.path.join(root, "run", "manifests")) | tree_digest(os.path.join(root, "run", "blobs"))
    assert after == before, "a failed start modified committed checkpoint files"


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("elastic_ft: error:")]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    return err[err.index("elastic_ft: error:"):]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optimiser.lr=1e-3", ["optimiser", "did you mean 'optimizer'"]),
        ("batch.global_bach=8", ["batch.global_bach", "did you mean 'global_batch'"]),
        ("optimizer.lr=-0.1", ["optimizer.lr", "-0.1"]),
        ("data.files=[/nonexistent/corpus.jsonl]", ["data.files[0]", "/nonexistent/corpus.jsonl", "does not exist"]),
    ],
)
def test_bad_spec_values(guarded, capsys, override, expected):
    assert train(guarded, "run", override) == 2
    message = error_of(capsys)
    for part in expected:
        assert part in message, message


def test_all_spec_problems_reported_at_once(guarded, capsys):
    assert train(guarded, "run", "optimizer.lr=-1", "batch.micro_batch=0", "batch.policy=fastest") == 2
    message = error_of(capsys)
    assert "3 problem(s)" in message
    for part in ("optimizer.lr", "batch.micro_batch", "batch.policy", "'fastest'"):
        assert part in message, message


def test_unsupported_uri_scheme(capsys):
    code = worker.main(["--spec", DEFAULT_SPEC, "--checkpoint_uri", "gs://bucket/runs"])
    assert code == 2
    message = error_of(capsys)
    assert "gs://bucket/runs" in message and "'gs'" in message and "s3://" in message


@pytest.mark.parametrize("field, value, expected", [
    ("run_id", "someone-else", "belongs to run 'someone-else'"),
    ("format", "elastic_ft.checkpoint/99", "has format 'elastic_ft.checkpoint/99'"),
])
def test_foreign_manifest_is_an_error_not_a_fallback(guarded, capsys, field, value, expected):
    # A newer manifest of another run (or format) placed in this run's directory.
    run_dir = os.path.join(guarded, "run")
    with open(os.path.join(run_dir, manifest_key(6))) as f:
        doc = json.load(f)
    doc[field], doc["step"] = value, 10
    foreign = os.path.join(run_dir, manifest_key(10))
    with open(foreign, "w") as f:
        json.dump(doc, f)
    assert train(guarded, "run", "steps=12") == 2
    message = error_of(capsys)
    assert expected in message and "000000000010.json" in message, message
    os.unlink(foreign)  # the guard checks that everything committed before is untouched


# --------------------------------------------------------------------------- issue 9: bounded inputs


def _alias_bomb() -> str:
    """4.8 million strings from 8 short lines of nested aliases (the old override copy expanded them all)."""
    lines = ["{l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 7)]
    return ", ".join(lines) + "}"


@pytest.mark.parametrize("override, expected", [
    ("optimizer.lr=.inf", "optimizer.lr: must be a finite number, got inf"),
    ("epochs=1e308", "epochs: must be in (0.0, 1000000.0], got 1e+308"),
    ("steps=" + "1" * 100_000, "steps: must be in [1, 1000000000], got <a number 100000 characters long>"),
    ("batch.global_batch=1000000000", "batch.global_batch: must be in [1, 16777216], got 1000000000"),
    ("model.config.x=" + _alias_bomb(), "model.config.x: override value is refused: it aliases (*name) expand it"),
], ids=["lr-inf", "epochs-1e308", "steps-100000-digits", "global-batch-1e9", "alias-bomb"])
def test_out_of_range_and_explosive_values(guarded, capsys, override, expected):
    extra = ["steps=null"] if override.startswith("epochs") else []
    start = time.monotonic()
    assert train(guarded, "run", "steps=1", *extra, override) == 2
    assert time.monotonic() - start < 30  # refused while loading the spec, before any model is built
    message = error_of(capsys)
    assert expected in message, message
    assert len(message) < 1000, message  # the 100,000-digit value is not echoed


def test_global_batch_larger_than_the_data(guarded, capsys):
    # Within the spec's range, but more than the 1024 samples of the data: a step would repeat samples.
    assert train(guarded, "run", "steps=1", "batch.global_batch=2000") == 2
    message = error_of(capsys)
    assert "batch.global_batch: a step would take 2000 samples, more than the dataset holds (1024)" in message


def test_alias_bomb_in_a_spec_file(tmp_path, capsys):
    with open(DEFAULT_SPEC) as f:
        text = f.read().replace("../data/", os.path.join(REPO, "data") + "/")
    path = tmp_path / "bomb.yaml"
    path.write_text(text.replace("  model_type: llama", "  model_type: llama\n    bomb: " + _alias_bomb()))
    start = time.monotonic()
    assert worker.main(["--spec", str(path), "--checkpoint_uri", f"file://{tmp_path}/runs", "steps=1"]) == 2
    assert time.monotonic() - start < 30
    assert f"file {str(path)!r} is refused: it aliases (*name) expand it to more than 10,000 values" in error_of(capsys)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind", ["directory", "latin-1"])
def test_spec_that_is_not_a_yaml_file(tmp_path, capsys, kind):
    if kind == "directory":
        path, expected = tmp_path, "is a directory; give the path of a YAML file"
    else:
        path, expected = tmp_path / "spec.yaml", "is not UTF-8 text (byte 0xe9 at offset 9)"
        path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    assert worker.main(["--spec", str(path), "--checkpoint_uri", f"file://{tmp_path}/runs"]) == 2
    assert f"file {str(path)!r} {expected}" in error_of(capsys)


def _files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_run_id_outside_checkpoint_uri_is_refused_by_the_worker(tmp_path, monkeypatch, capsys):
    # '--run_id ../escaped' trained and wrote checkpoints to <root>/escaped, beside checkpoint_uri.
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the default log dir is relative to the working directory
    with pytest.raises(SystemExit) as info:
        worker.main(["--spec", DEFAULT_SPEC, "--run_id", "../escaped", "--checkpoint_uri", f"file://{work}/runs",
                     "steps=1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --run_id/--run-id: must use only letters, digits" in err and "'../escaped'" in err
    assert _files_under(tmp_path) == []


@pytest.mark.parametrize("name", ["..", "x" * 300])
def test_spec_name_that_cannot_be_a_run_id(tmp_path, monkeypatch, capsys, name):
    # With no --run_id the spec's name is the run id: 'name: ..' wrote into checkpoint_uri's parent,
    # and a 300-character name trained, then failed at the first save.
    monkeypatch.chdir(tmp_path)
    assert worker.main(["--spec", DEFAULT_SPEC, "--checkpoint_uri", f"file://{tmp_path}/runs", "steps=1",
                        f"name={name}"]) == 2
    message = error_of(capsys)
    assert "  - name: " in message and "(it is the default run id)" in message
    assert _files_under(tmp_path) == []


@pytest.mark.torchrun
def test_run_id_outside_checkpoint_uri_is_refused_by_the_torchx_component(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name in ("specs", "data"):
        os.symlink(os.path.join(REPO, name), work / name)
    proc = run([os.path.join(BIN, "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path}/torchx-logs",
                "elastic_ft.train", "--run_id", "../escaped", "--nproc_per_node", "1",
                "--checkpoint_uri", f"file://{work}/runs", "steps=1"], cwd=str(work), timeout=300)
    assert proc.returncode != 0, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert "--run_id must use only letters, digits" in last and "'../escaped'" in last, explain(proc)
    assert _files_under(tmp_path) == [], "a refused submission wrote files"


@pytest.mark.parametrize("flag, value, expected", [
    ("--keep-last", "-5", "argument --keep-last: must be in [1, 1000000], got '-5'"),
    ("--keep-every", "0", "argument --keep-every: must be in [1, 1000000000], got '0'"),
    ("--grace", "-100", "argument --grace: must be in [0.0, 100000000.0], got '-100'"),
])
@pytest.mark.subprocess
def test_gc_refuses_retention_values_out_of_range(guarded, flag, value, expected):
    # 'ckpt gc --keep-last -5' deleted two of the three good checkpoints; the guard proves nothing changed.
    proc = cli("ckpt", "gc", f"file://{guarded}/run", flag, value)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines()[-1] == f"elastic-ft ckpt gc: error: {expected}", explain(proc)
