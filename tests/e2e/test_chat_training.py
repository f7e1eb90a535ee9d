"""Chat data end to end: specs/tiny-chat-lora.yaml trains in this process (the worker's own entry point,
world 1) and its loss falls, counting only the assistant turns' tokens; a bad conversation through the
`elastic-ft train` command is one error line naming the file's line, no traceback."""

from __future__ import annotations

import json
import os

import pytest

from elastic_ft import worker
from elastic_ft.runevents.events import read_events
from tests.conftest import REPO, cli, explain, process_env

CHAT_SPEC = os.path.join(REPO, "specs", "tiny-chat-lora.yaml")
CHAT_DATA = os.path.join(REPO, "data", "tiny-chat.jsonl")


@pytest.mark.slow
def test_the_chat_spec_trains_and_its_loss_falls(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "node-cache"))
    logs = str(tmp_path / "run" / "logs")
    code = worker.main(["--spec", CHAT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{tmp_path}",
                        "--log_dir", logs, "steps=8", "checkpoint.every_steps=100"])
    assert code == 0
    steps = [e for e in read_events(os.path.join(logs, "events.jsonl")) if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 9))
    losses = [e["loss"] for e in steps]
    # From about ln(259) = 5.56, a uniform guess over the byte vocabulary, down by more than a nat in 8 steps.
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses
    # Only the assistant turns are targets: far fewer than the tokens each step reads.
    assert all(0 < e["tokens"] < 0.5 * e["real_tokens"] for e in steps), steps


@pytest.mark.torchrun  # the process guard counts `elastic-ft train` as a worker process
@pytest.mark.slow
def test_a_bad_conversation_through_the_cli_is_one_line(tmp_path):
    rows = [json.loads(line) for line in open(CHAT_DATA)]
    rows[6] = {"messages": [{"role": "user", "content": "2 + 2?"}, {"content": "4."}]}
    bad = tmp_path / "chat.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = cli("train", "--spec", CHAT_SPEC, "--run_id", "bad", "--checkpoint_uri", f"file://{tmp_path}/runs",
               f"data.files=[{bad}]", "steps=2", env=process_env(ELASTIC_FT_INPUT_CACHE=str(tmp_path / "node-cache")))
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and "WARNING" not in line]
    assert errors == [f"elastic_ft: error: data.files[0]:7: field 'messages' message 2 has no 'role' (one of system, "
                      f"user, assistant, tool); fix or remove line 7 of {str(bad)!r}"], explain(proc)
    assert proc.stderr.splitlines()[-1] == errors[0], explain(proc)
