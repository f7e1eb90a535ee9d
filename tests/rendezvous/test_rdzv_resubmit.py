"""A run id used again, and a node lost while joining: torchrun agents, real etcd.

On c10d the rendezvous store dies with its job, so the same command submitted
again starts afresh. On etcd3 the state outlives the job; these tests hold it
to the same behaviour: a completed run is found complete by the job, a failed
one resumes, and a node lost while joining costs the others seconds, never
the rendezvous.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agents import read_jsonl, rendezvous_state_of, stop_leftovers, torchrun_agent, wait_for
from elastic_ft.rendezvous.handler import create_handler

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.etcd]


def step_counts(out: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for record in read_jsonl(out / "steps.jsonl"):
        counts[record["step"]] = counts.get(record["step"], 0) + 1
    return counts


def rendezvous_state(endpoint: str, run_id: str):  # type: ignore[no-untyped-def]
    """A function reading the run's rendezvous state (torch's pickled state) from etcd."""
    backend = create_handler(RendezvousParameters("etcd3", endpoint, run_id, 1, 2))._state_holder._backend

    return lambda: rendezvous_state_of(backend)


def run_twice(endpoint: str, run_id: str, out, job: dict, check_first):  # type: ignore[no-untyped-def]
    """One agent runs ``job`` to its end; ``check_first(exit code, rendezvous state, agent)``; then the
    same command again: its agent and exit code. Agents left running are stopped."""
    state = rendezvous_state(endpoint, run_id)
    first = torchrun_agent(endpoint, run_id, out, name="first", **job)
    agents = [first]
    try:
        check_first(first.wait(timeout=120), state(), first)
        again = torchrun_agent(endpoint, run_id, out, name="again", **job)
        agents.append(again)
        return again, again.wait(timeout=120)
    finally:
        stop_leftovers(agents)


def test_same_command_after_the_run_completed_finds_it_done(etcd, run_id, tmp_path):
    """Run to completion, then the same command: it forms a rendezvous, the job
    reads its progress (all steps done), runs none again and exits 0."""
    def completed(code: int, state, first) -> None:  # type: ignore[no-untyped-def]
        assert code == 0, first.tail()
        assert state.closed and not state.participants  # completed: closed, and it left

    job = dict(nproc=1, nnodes="1", steps=3, max_restarts=0)
    again, code = run_twice(etcd.endpoint, run_id, tmp_path, job, completed)
    assert code == 0, again.tail()
    assert "RendezvousClosedError" not in again.tail(20000)
    # The second job started its worker (a second incarnation) and found nothing to do.
    assert len(read_jsonl(tmp_path / "workers.jsonl")) == 2
    assert step_counts(tmp_path) == {1: 1, 2: 1, 3: 1}


def test_same_command_after_the_job_failed_resumes_it(etcd, run_id, tmp_path):
    """Workers fail past --max-restarts (torchrun then shuts the handler down);
    the same command resumes from the progress the failed job left."""
    def failed(code: int, state, first) -> None:  # type: ignore[no-untyped-def]
        assert code != 0, first.tail()
        assert step_counts(tmp_path) == {1: 1, 2: 1}
        assert not state.closed and not state.participants  # failed: it left, the run stays open

    job = dict(nproc=1, nnodes="1", steps=5, max_restarts=0, job_args=("--fail-once-at", "3"))
    again, code = run_twice(etcd.endpoint, run_id, tmp_path, job, failed)
    assert code == 0, again.tail()
    assert step_counts(tmp_path) == {step: 1 for step in range(1, 6)}


def test_node_sigtermed_while_joining_costs_the_survivor_seconds_and_the_run_stays_open(
    etcd, run_id, tmp_path
):
    # A round below max nodes completes 3 s after its first member arrives;
    # torch drops a node 5 s after its last heartbeat: long enough that the
    # round completes with the dying joiner in it, as it did when the survivor
    # then waited 300 s for the joiner's keys.
    conf = "last_call_timeout=3,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=5"
    job = dict(nproc=1, nnodes="1:3", steps=400, step_time=0.3, conf=conf)
    state = rendezvous_state(etcd.endpoint, run_id)
    survivor = torchrun_agent(etcd.endpoint, run_id, tmp_path, name="survivor", **job)
    agents = [survivor]
    try:
        wait_for(lambda: len(read_jsonl(tmp_path / "steps.jsonl")) >= 2, 180,
                 "two steps at world size 1", agents)
        joiner = torchrun_agent(etcd.endpoint, run_id, tmp_path, name="joiner", **job)
        agents.append(joiner)

        def joining() -> bool:
            s = state()
            return s is not None and len(s.participants) == 2 and not s.complete

        wait_for(joining, 120, "the joiner among the participants of a new round", agents)
        os.kill(joiner.pid, signal.SIGTERM)
        lost_at = time.monotonic()
        joiner.wait(timeout=30)
        steps_before = len(read_jsonl(tmp_path / "steps.jsonl"))

        # The survivor runs again, alone, long before a 300 s store timeout. One
        # deadline counted from the loss: a clock check after a 60 s wait could
        # fail although the wait passed (it started after the joiner's exit), and
        # 150 s leaves a busy machine room for the worker restart (torch imports).
        within = 150 - (time.monotonic() - lost_at)
        wait_for(lambda: len(read_jsonl(tmp_path / "steps.jsonl")) > steps_before, within,
                 "the survivor to train again within 150 s of losing the joiner", [survivor])
        assert not state().closed

        # A node started for the run now joins the running job.
        late = torchrun_agent(etcd.endpoint, run_id, tmp_path, name="late", **job)
        agents.append(late)
        wait_for(lambda: any(r["world_size"] == 2 for r in read_jsonl(tmp_path / "steps.jsonl")),
                 180, "a step at world size 2 with the late node", [survivor, late])
        assert late.pid in {w["agent_pid"] for w in read_jsonl(tmp_path / "workers.jsonl")
                            if w["world_size"] == 2}
        assert "RendezvousClosedError" not in late.tail(20000)
    finally:
        stop_leftovers(agents)
