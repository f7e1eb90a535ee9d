"""A real torchrun job (standalone, 2 workers, gloo, the tiny model) preempted mid-run, then resumed.

A terminate notice served by the local IMDS, then (the same command run
again) SIGTERM to the torchrun agent: each time the workers agree at the next
step boundary, commit that step, exit with PREEMPTED_EXIT_CODE, and the same
command run again resumes at the next step; the third run finishes. The
ledger proves every sample was learned exactly once. A notice is switched on
only once the job has logged a few steps (or answered the previous notice),
and the run is long enough that it cannot end before the notice, seen within
0.1 s, is answered: 120 steps, where the job left 4 to 7 steps after the
rebalance recommendation was served (its checkpoint, then the terminate
notice) and 1 to 4 steps after SIGTERM (measured at loads of 7 and 18 on 2
cores, where the steps and the test's polls slow down together); the
steps after the last leave are trained by the third run (300 cost ~6 s more
on CI). One job takes both leaves: each needs a job started, and trained to
its end after it (a job apiece cost the suite a torchrun start and a run's
steps more).
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

STEPS = 120
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


def check_left(root: str, run_id: str, notice: str, after: int) -> int:
    """The attempt that just ended left on ``notice`` at a step S (committed, the newest), more than 3 steps
    after it resumed at ``after``, and trained nothing after S; S."""
    events = events_of(root, run_id)
    decisions = [e for e in events if e["event"] == "spot_decision" and e["notice"] == notice]
    assert [(d["notice"], d["action"]) for d in decisions] in (
        [(notice, "checkpoint_and_leave")], [(notice, "flush_and_leave")]), decisions
    left_at = decisions[0]["step"]
    attempt = decisions[0]["attempt"]
    assert all(e["step"] <= left_at for e in events if e["event"] == "step" and e["attempt"] == attempt), \
        "a step was trained after the leave"
    (preempted,) = [e for e in events if e["event"] == "preempted" and e["attempt"] == attempt]
    assert preempted["step"] == left_at and preempted["exit_code"] == PREEMPTED_EXIT_CODE
    assert after + 3 <= left_at < STEPS
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert max(committed) == left_at, "the step the notice interrupted was not the newest committed"
    assert not any(e["event"] == "end" for e in events)
    return left_at


def check_resumed_after(root: str, run_id: str, left_at: int) -> None:
    """The newest attempt resumed at ``left_at``: its first step trained is the one after the commit."""
    events = events_of(root, run_id)
    resumed = max(i for i, e in enumerate(events) if e["event"] == "resume_plan")
    assert events[resumed]["step"] == left_at, events[resumed]
    trained_again = [e["step"] for e in events[resumed:] if e["event"] == "ledger"]
    assert trained_again[0] == left_at, "the first step trained after resume is not the one after the commit"


def test_a_notice_then_a_sigterm_each_commit_the_interrupted_step_and_a_rerun_resumes_after_it(run_root, imds):
    """One job, left twice: on a terminate notice (after a rebalance recommendation's early checkpoint), then,
    run again with the same command, on SIGTERM to its torchrun agent (a container stop); run a third time,
    it trains to the end. Each leave commits the step it interrupted and the next run resumes after it.
    (One job for both leaves: each needs a job started and trained to its end after it.)"""
    proc = start(run_root, "job", imds.url)
    wait_for_step(proc, run_root, "job", 3)
    # First a rebalance recommendation: one early checkpoint, and the job trains on.
    imds.set_rebalance({"noticeTime": in_two_minutes()})
    early = wait_for_event(proc, run_root, "job", "the early checkpoint",
                           lambda e: e["event"] == "spot_decision" and e["action"] == "early_checkpoint")
    wait_for_event(proc, run_root, "job", "the early checkpoint's commit",
                   lambda e: e["event"] == "checkpoint_committed" and e["reason"].startswith("spot: rebalance"))
    wait_for_step(proc, run_root, "job", early["step"] + 1)
    imds.set_instance_action({"action": "terminate", "time": in_two_minutes()})
    first = finish(proc)
    assert first.returncode != 0, explain(first)
    # torchrun (no restarts left) fails the job and names the worker's exit code.
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in first.stderr, explain(first)
    # One line for the node (its local rank 0), not one per rank.
    assert first.stderr.count("elastic_ft: preempted: left on a terminate notice at step") == 1, explain(first)
    events = events_of(run_root, "job")
    assert [e["step"] for e in events if e["event"] == "spot_decision" and e["action"] == "early_checkpoint"] == \
        [early["step"]], "one early checkpoint per recommendation"
    assert early["step"] in [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    noticed_at = check_left(run_root, "job", "terminate", after=0)

    # The same command, the notice gone; a few steps after it resumed, SIGTERM to the agent.
    imds.set_instance_action(None)
    imds.set_rebalance(None)
    proc = start(run_root, "job", imds.url)
    wait_for_step(proc, run_root, "job", noticed_at + 3)
    check_resumed_after(run_root, "job", noticed_at)
    proc.send_signal(signal.SIGTERM)  # what a container stop (Batch TerminateJob) sends torchrun
    second = finish(proc)
    assert second.returncode != 0, explain(second)
    assert "elastic_ft: stopped by SIGTERM at step" in second.stderr, explain(second)
    assert "SIGKILL" not in second.stderr, explain(second)
    stopped_at = check_left(run_root, "job", "sigterm", after=noticed_at)

    again = finish(start(run_root, "job", imds.url))  # the same command once more: to the end
    assert again.returncode == 0, explain(again)
    check_resumed_after(run_root, "job", stopped_at)
    events = events_of(run_root, "job")
    assert [e["step"] for e in events if e["event"] == "resume_plan"] == [0, noticed_at, stopped_at]
    history = replay(events)
    assert sorted(history) == list(range(STEPS))
    assert check_exactly_once(history, 1024) == []
    assert events[-1]["event"] == "end" and events[-1]["step"] == STEPS
