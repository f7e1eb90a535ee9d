"""A real torchrun job (standalone, 2 workers, gloo, the tiny model) preempted mid-run, then resumed.

A terminate notice served by the local IMDS, or SIGTERM to the torchrun
agent: the workers agree at the next step boundary, commit that step, exit
with PREEMPTED_EXIT_CODE, and the same command run again resumes at the next
step and finishes. The ledger proves every sample was learned exactly once.
A notice is switched on only once the job has logged a few steps (or
answered the previous notice), and the run is long enough (about 8 s of
steps here) that it cannot end before the notice, seen within 0.1 s, is
answered.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys

import pytest

from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.spot.imds import ENDPOINT_ENV
from elastic_ft.train.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import DEFAULT_SPEC, REPO, explain, process_env
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

STEPS = 300
WAIT_S = 240.0  # generous bounds: CI's 2 cores are loaded


def command(root: str, run_id: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0", "-m", "elastic_ft.worker", "--spec", DEFAULT_SPEC, "--run_id", run_id,
            "--checkpoint_uri", f"file://{root}", "--log_dir", os.path.join(root, run_id, "logs"),
            f"steps={STEPS}", "checkpoint.every_steps=10", "checkpoint.keep_last=null", "logging.ledger=true",
            "logging.every_steps=1", "spot.poll_interval_s=0.1",
            "spot.imds_timeout_s=5"]  # generous: a loaded CI must not time the first probes out


def start(root: str, run_id: str, imds_url: str) -> subprocess.Popen:
    env = process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **{ENDPOINT_ENV: imds_url})
    return subprocess.Popen(command(root, run_id), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def events_of(root: str, run_id: str) -> list[dict]:
    path = os.path.join(root, run_id, "logs", "events.jsonl")
    return read_events(path) if os.path.exists(path) else []


def wait_for_event(proc: subprocess.Popen, root: str, run_id: str, what: str, match) -> dict:
    """The first event ``match`` accepts, once the job has written it (fails if the job ends first)."""

    def running() -> None:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}\n{explain(finish(proc))}")

    def stop_it() -> str:
        proc.kill()
        return explain(finish(proc))

    return wait_until(lambda: next((e for e in events_of(root, run_id) if match(e)), None), timeout=WAIT_S,
                      what=what, interval=0.05, check=running, on_timeout=stop_it)


def wait_for_step(proc: subprocess.Popen, root: str, run_id: str, step: int) -> None:
    wait_for_event(proc, root, run_id, f"step {step}", lambda e: e["event"] == "step" and e["step"] >= step)


def in_two_minutes() -> str:
    when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def check_left_and_resumed(root: str, run_id: str, notice: str, imds_url: str) -> None:
    """The first attempt's events show one leave at step S with S committed; a rerun resumes at S and ends."""
    events = events_of(root, run_id)
    decisions = [e for e in events if e["event"] == "spot_decision" and e["notice"] == notice]
    assert [(d["notice"], d["action"]) for d in decisions] in (
        [(notice, "checkpoint_and_leave")], [(notice, "flush_and_leave")]), decisions
    left_at = decisions[0]["step"]
    assert all(e["step"] <= left_at for e in events if e["event"] == "step"), "a step was trained after the leave"
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    assert preempted["step"] == left_at and preempted["exit_code"] == PREEMPTED_EXIT_CODE
    assert 3 <= left_at < STEPS
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert max(committed) == left_at, "the step the notice interrupted was not the newest committed"
    assert not any(e["event"] == "end" for e in events)

    again = finish(start(root, run_id, imds_url))  # the same command, the notice gone
    assert again.returncode == 0, explain(again)
    events = events_of(root, run_id)
    resumes = [e["step"] for e in events if e["event"] == "resume_plan"]
    assert resumes == [0, left_at]
    second = next(i for i, e in enumerate(events) if e["event"] == "resume_plan" and e["step"] == left_at)
    trained_again = [e["step"] for e in events[second:] if e["event"] == "ledger"]
    assert trained_again[0] == left_at, "the first step trained after resume is not the one after the commit"
    history = replay(events)
    assert sorted(history) == list(range(STEPS))
    assert check_exactly_once(history, 1024) == []
    assert events[-1]["event"] == "end" and events[-1]["step"] == STEPS


def test_terminate_notice_commits_the_interrupted_step_and_a_rerun_resumes_after_it(run_root, imds):
    proc = start(run_root, "notice", imds.url)
    wait_for_step(proc, run_root, "notice", 3)
    # First a rebalance recommendation: one early checkpoint, and the job trains on.
    imds.set_rebalance({"noticeTime": in_two_minutes()})
    early = wait_for_event(proc, run_root, "notice", "the early checkpoint",
                           lambda e: e["event"] == "spot_decision" and e["action"] == "early_checkpoint")
    wait_for_event(proc, run_root, "notice", "the early checkpoint's commit",
                   lambda e: e["event"] == "checkpoint_committed" and e["reason"].startswith("spot: rebalance"))
    wait_for_step(proc, run_root, "notice", early["step"] + 1)
    imds.set_instance_action({"action": "terminate", "time": in_two_minutes()})
    first = finish(proc)
    assert first.returncode != 0, explain(first)
    # torchrun (no restarts left) fails the job and names the worker's exit code.
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in first.stderr, explain(first)
    # One line for the node (its local rank 0), not one per rank.
    assert first.stderr.count("elastic_ft: preempted: left on a terminate notice at step") == 1, explain(first)
    events = events_of(run_root, "notice")
    assert [e["step"] for e in events if e["event"] == "spot_decision" and e["action"] == "early_checkpoint"] == \
        [early["step"]], "one early checkpoint per recommendation"
    assert early["step"] in [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    imds.set_instance_action(None)
    imds.set_rebalance(None)
    check_left_and_resumed(run_root, "notice", "terminate", imds.url)


def test_sigterm_to_the_agent_commits_the_interrupted_step_and_a_rerun_resumes_after_it(run_root, imds):
    proc = start(run_root, "sigterm", imds.url)
    wait_for_step(proc, run_root, "sigterm", 3)
    proc.send_signal(signal.SIGTERM)  # what a container stop (Batch TerminateJob) sends torchrun
    first = finish(proc)
    assert first.returncode != 0, explain(first)
    assert "elastic_ft: stopped by SIGTERM at step" in first.stderr, explain(first)
    assert "SIGKILL" not in first.stderr, explain(first)
    check_left_and_resumed(run_root, "sigterm", "sigterm", imds.url)
