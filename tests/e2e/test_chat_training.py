"""Chat data end to end: specs/tiny-chat-lora.yaml trains in this process (the worker's own entry point,
world 1) and its loss falls, counting only the assistant turns' tokens; a bad conversation through the
`elastic-ft train` command is one error line naming the file's line, no traceback; the chat store built by a
2-process torchrun world is byte-identical to a 1-process build."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from elastic_ft import worker
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.config import DataConfig
from elastic_ft.runevents.events import read_events
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import byte_tokenizer
from elastic_ft.train.token_store import FILES
from tests.conftest import REPO, cli, explain, process_env, run

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


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_ranks_build_the_chat_store_byte_identical_to_one(tmp_path, monkeypatch):
    # Each rank renders its share of the conversations; the leader's concatenation is the 1-process build's bytes.
    configs = [DataConfig(files=[CHAT_DATA], messages_field="messages", max_length=96),  # some cut
               DataConfig(files=[CHAT_DATA], messages_field="messages", max_length=64, packing=True)]
    two_cache = tmp_path / "cache-2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(os.path.dirname(__file__), "token_store_ranks.py"), str(tmp_path / "runs-2" / "r"),
           *(json.dumps(dataclasses.asdict(c)) for c in configs)]
    proc = run(cmd, env=process_env(ELASTIC_FT_INPUT_CACHE=str(two_cache), PYTHONPATH=REPO), timeout=300)
    assert proc.returncode == 0, explain(proc)
    reported = [line.split() for line in proc.stdout.splitlines() if line.startswith("identity ")]
    assert [r[3] for r in reported] == ["True", "True"], proc.stdout
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "cache-1"))
    for cfg, line in zip(configs, reported):
        one_rank = LocalStore(str(tmp_path / "runs-1" / "r"))
        store, built = data_mod.load_with_report(cfg, byte_tokenizer(), store=one_rank, run_id="r")
        assert built.built and built.identity == line[1]
        assert 0 < int(store.trained.sum()) < len(store.trained)  # assistant turns only
        for name in FILES:
            ours = (tmp_path / "cache-1" / "tokens" / built.identity / name).read_bytes()
            theirs = (two_cache / "tokens" / built.identity / name).read_bytes()
            assert ours == theirs, (cfg.packing, name)
