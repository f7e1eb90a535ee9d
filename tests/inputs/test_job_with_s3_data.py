"""The real trainer (the worker's entry point, in this process, world 1) with its data file given as s3://:
it trains from the node's cached copy, a second run on the node reuses it, and a missing object ends
the worker with one line naming the field and the URI (exit code 2)."""

from __future__ import annotations

import os

from elastic_ft import worker
from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, REPO

DATA = os.path.join(REPO, "data", "tiny-corpus.jsonl")


def _train(root: str, run_id: str, data_uri: str, cache_dir: str) -> int:
    return worker.main(["--spec", DEFAULT_SPEC, "--run_id", run_id, "--checkpoint_uri", f"file://{root}",
                        "--log_dir", os.path.join(root, run_id, "logs"), "steps=2", "checkpoint.every_steps=2",
                        "logging.every_steps=1", f'data.files=["{data_uri}"]', f"inputs.cache_dir={cache_dir}",
                        "checkpoint.s3.max_attempts=3", "checkpoint.s3.backoff_initial=0.01"])


def test_job_trains_on_an_s3_data_file_fetched_once_per_node(moto_remote, tmp_path):
    remote = moto_remote
    with open(DATA, "rb") as f:
        remote.put("corpus/tiny-corpus.jsonl", f.read())
    uri, root = remote.uri("corpus/tiny-corpus.jsonl"), str(tmp_path / "runs")
    assert _train(root, "first", uri, remote.cache_dir) == 0
    events = read_events(os.path.join(root, "first", "logs", "events.jsonl"))
    assert events[-1]["event"] == "end" and events[-1]["step"] == 2
    assert remote.gets("corpus/") == 1

    assert _train(root, "second", uri, remote.cache_dir) == 0  # a retried job on the same host
    assert remote.gets("corpus/") == 1, "the second run downloaded the data again"


def test_missing_s3_data_file_ends_the_worker_with_one_line(moto_remote, tmp_path, capsys):
    uri = moto_remote.uri("corpus/missing.jsonl")
    assert _train(str(tmp_path / "runs"), "missing", uri, moto_remote.cache_dir) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"elastic_ft: error: data.files[0]: {uri} does not exist"
