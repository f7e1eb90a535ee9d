"""A node that goes silent, or is lost while a new round's workers start: the survivors go on.

The agents watch their round's members through the etcd3 handler's
``num_nodes_waiting``: a member whose keep-alive expired counts as a
membership change, so torch's agent restarts its workers in a new round
without it, even while no collective fails. Both tests give the process group
a 600 s timeout, far above their own deadlines: a survivor that waited for
the collective (or process-group start) to time out would fail the test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agents import Agent, read_jsonl, split_at_rank, stop_leftovers, torchrun_agent, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.etcd]

# Far above every deadline below: only the agents' keep-alive check can end the waits in time.
PG_TIMEOUT = ("--pg-timeout", "600")
# A 1 s heartbeat and 3 attempts: a member counts as lost 3 s after its last heartbeat.
CONF = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
DEADLINE = 150  # generous for CI's loaded cores; 4x below PG_TIMEOUT


def steps_at(out: Path, size: int, after: int = 0) -> list[dict]:
    return [s for s in read_jsonl(out / "steps.jsonl") if s["world_size"] == size and s["step"] > after]


def last_step(out: Path) -> int:
    records = read_jsonl(out / "steps.jsonl")
    return records[-1]["step"] if records else 0


def assert_loss_line(survivor: Agent, victim: Agent) -> None:
    """The survivor's one line names the lost node (its agent's pid is in torch's node name)."""
    lines = [line for line in survivor.tail(200_000).splitlines() if "without them" in line]
    assert lines, survivor.tail()
    assert re.search(rf"_{victim.pid}_\d+ \((left the round|keep-alive expired)", lines[0]), lines[0]


def test_a_silent_node_is_dropped_and_the_survivor_trains_in_a_smaller_world(etcd, run_id, tmp_path):
    steps = 40  # a bound: once the survivor trained alone, the stop file ends the job
    stop_file = tmp_path / "stop"
    agents = [
        torchrun_agent(etcd.endpoint, run_id, tmp_path, nproc=1, nnodes="1:2", steps=steps, conf=CONF,
                       name=f"agent{i}", job_args=(*PG_TIMEOUT, "--stop-file", str(stop_file)))
        for i in range(2)
    ]
    victim = None
    try:
        wait_for(lambda: len(steps_at(tmp_path, 2)) >= 2, 180, "two steps at world size 2", agents)
        full = [w for w in read_jsonl(tmp_path / "workers.jsonl") if w["world_size"] == 2][:2]
        victim, survivors = split_at_rank(agents, full, lambda rank: rank != 0)
        victim.stop_tree()
        # Read once the victim is stopped: at most the step whose all_reduce already completed follows.
        stopped_at = last_step(tmp_path)
        wait_for(lambda: steps_at(tmp_path, 1, after=stopped_at), DEADLINE,
                 "a step at world size 1 after the node went silent", survivors)
        victim.kill_tree()
        stop_file.touch()  # the survivor trains alone: the rest of the steps proves nothing more
        for agent in survivors:
            assert agent.wait(timeout=DEADLINE) == 0, agent.tail()
        assert_loss_line(survivors[0], victim)
    finally:
        stop_leftovers(agents)
    records = read_jsonl(tmp_path / "steps.jsonl")
    assert {r["step"] for r in records} == set(range(1, records[-1]["step"] + 1))
    assert {r["world_size"] for r in records if r["step"] > stopped_at + 1} == {1}


def test_a_node_lost_while_its_round_starts_its_workers_is_dropped(etcd, run_id, tmp_path):
    """The joiner is killed as soon as its round completes: the survivor's new workers wait in
    process-group start for its rank, until the survivor's agent sees its keep-alive expire."""
    steps = 60  # a bound: once the survivor trained alone, the stop file ends the job
    stop_file = tmp_path / "stop"
    start = dict(nproc=1, nnodes="1:2", steps=steps, step_time=0.3, conf=CONF,
                 job_args=(*PG_TIMEOUT, "--stop-file", str(stop_file)))
    agents = [torchrun_agent(etcd.endpoint, run_id, tmp_path, name="first", **start)]
    try:
        wait_for(lambda: len(steps_at(tmp_path, 1)) >= 2, 180, "two steps at world size 1", agents)
        joiner = torchrun_agent(etcd.endpoint, run_id, tmp_path, name="joiner", **start)
        agents.append(joiner)
        wait_for(lambda: "Rendezvous complete for workers" in joiner.tail(200_000), 180,
                 "the joiner's round to complete", agents)
        joiner.kill_tree()
        killed_at = last_step(tmp_path)
        wait_for(lambda: steps_at(tmp_path, 1, after=killed_at), DEADLINE,
                 "a step at world size 1 after the joiner was lost", agents[:1])
        stop_file.touch()  # the survivor trains alone: the rest of the steps proves nothing more
        assert agents[0].wait(timeout=DEADLINE) == 0, agents[0].tail()
        assert_loss_line(agents[0], joiner)
    finally:
        stop_leftovers(agents)
    records = read_jsonl(tmp_path / "steps.jsonl")
    assert {r["step"] for r in records} == set(range(1, records[-1]["step"] + 1))
