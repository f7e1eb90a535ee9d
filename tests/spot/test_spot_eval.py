"""A spot notice during an evaluation: the job leaves without finishing it, and the resume evaluates that step.

A real torchrun job (2 workers, gloo, the tiny model, the local IMDS) evaluates 4,096 held-out samples at
step 2 (``data.eval_files``: 256 micro-batches per rank, seconds of work). A terminate notice is served
as soon as the evaluation has started: the ranks agree between micro-batches, abandon it, commit step 2
and leave. The same command (with fewer eval samples, to keep the test short: ``eval`` is not part of the
config hash) resumes at step 2, evaluates it first, then trains on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic_ft.spot.imds import ENDPOINT_ENV
from elastic_ft.train.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import DEFAULT_SPEC, REPO, explain, process_env
from tests.spot.test_spot_preemption import events_of, finish, in_two_minutes, wait_for_event

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

EVAL_SAMPLES = 4096


def eval_file(tmp_path) -> str:
    """The demo corpus four times over: 4,096 held-out samples."""
    with open(os.path.join(REPO, "data", "tiny-corpus.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * (EVAL_SAMPLES // len(rows))))
    return str(path)


def start(root: str, run_id: str, imds_url: str, held_out: str, max_samples: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "-m", "elastic_ft.worker", "--spec", DEFAULT_SPEC, "--run_id", run_id,
           "--checkpoint_uri", f"file://{root}", "--log_dir", os.path.join(root, run_id, "logs"),
           "steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=null", "logging.every_steps=1",
           f"data.eval_files=[{held_out}]", "eval.every_steps=2", f"eval.max_samples={max_samples}",
           "spot.poll_interval_s=0.1", "spot.imds_timeout_s=5"]
    env = process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **{ENDPOINT_ENV: imds_url})
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_notice_during_an_evaluation_leaves_without_it_and_the_resume_evaluates_that_step(run_root, imds,
                                                                                           tmp_path):
    held_out = eval_file(tmp_path)
    proc = start(run_root, "evalnotice", imds.url, held_out, EVAL_SAMPLES)
    wait_for_event(proc, run_root, "evalnotice", "the evaluation of step 2",
                   lambda e: e["event"] == "eval_started" and e["step"] == 2)
    imds.set_instance_action({"action": "terminate", "time": in_two_minutes()})
    first = finish(proc)
    assert first.returncode != 0, explain(first)
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in first.stderr, explain(first)

    events = events_of(run_root, "evalnotice")
    (abandoned,) = [e for e in events if e["event"] == "eval_abandoned"]
    # It left without waiting for the evaluation: stopped between micro-batches, far from the end.
    assert abandoned["step"] == 2 and abandoned["per_rank_done"] < abandoned["per_rank"] == EVAL_SAMPLES // 8 // 2, \
        abandoned
    assert not [e for e in events if e["event"] == "eval"], "an abandoned evaluation reported a loss"
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    assert preempted["step"] == 2 and events.index(preempted) > events.index(abandoned)
    assert all(e["step"] <= 2 for e in events if e["event"] == "step"), "a step was trained after the notice"
    assert max(e["step"] for e in events if e["event"] == "checkpoint_committed") == 2

    imds.set_instance_action(None)
    again = finish(start(run_root, "evalnotice", imds.url, held_out, 64))
    assert again.returncode == 0, explain(again)
    events = events_of(run_root, "evalnotice")
    second = [e for e in events if e.get("attempt") == 2]
    assert [e["step"] for e in second if e["event"] == "resume_plan"] == [2]
    names = [(e["event"], e.get("step")) for e in second if e["event"] in ("eval", "step")]
    # Redone after the resume, before any step is trained; then the last step's.
    assert names == [("eval", 2), ("step", 3), ("step", 4), ("eval", 4)], names
    assert events[-1]["event"] == "end" and events[-1]["step"] == 4
