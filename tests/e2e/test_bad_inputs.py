"""Bad inputs: one clear error naming the field or object, and no committed
checkpoint touched (every file of the run hashes the same afterwards)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from elastic_ft import worker
from elastic_ft.checkpoint.manifest import manifest_key
from tests.conftest import DEFAULT_SPEC, explain, torchrun, tree_digest
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


@pytest.mark.slow
def test_global_batch_smaller_than_world(guarded):
    proc = torchrun(2, ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{guarded}",
                        "--log_dir", os.path.join(guarded, "logs"), "batch.global_batch=1"])
    assert proc.returncode != 0
    assert "batch.global_batch (1) is smaller than the world size (2)" in proc.stderr, explain(proc)

