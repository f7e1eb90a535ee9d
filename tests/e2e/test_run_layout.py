"""Where a run's events go when no --log_dir is given: beside its checkpoints, whatever the working directory."""

from __future__ import annotations

import os

import pytest

from elastic_ft import worker
from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, cli, explain

pytestmark = pytest.mark.subprocess  # `elastic-ft goodput`


def test_events_live_in_the_run_directory_of_an_absolute_checkpoint_uri(tmp_path, monkeypatch):
    root, elsewhere = tmp_path / "ckpt", tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert worker.main(["--spec", DEFAULT_SPEC, "--run_id", "r", "--checkpoint_uri", f"file://{root}", "steps=2"]) == 0
    assert os.listdir(elsewhere) == []  # nothing under the working directory
    events = read_events(str(root / "r" / "logs" / "events.jsonl"))
    assert [e["event"] for e in events][-1] == "end"

    for name in (f"file://{root}/r", str(root / "r")):
        out = cli("goodput", name)
        assert out.returncode == 0, explain(out)
        assert "over 1 attempt(s)" in out.stdout
