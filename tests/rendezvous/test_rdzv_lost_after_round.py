"""A node lost after its round completed, before training: the survivor starts a new round and trains in
the smaller world; no agent fails.

Every agent is held at a phase (``ELASTIC_FT_AGENT_HOLD``, :mod:`elastic_ft.rendezvous.agent_faults`);
once both are held, one node's whole process tree is killed and the other is released:

- ``assign_ranks``: the survivor then exchanges its workers' ranks through the round's store, which waits
  for the lost node's key (its role if the victim is not group rank 0, else the ranks group rank 0
  assigns). The old code raised ``WritersLostError`` out of torch's ``_initialize_workers`` and the
  agent exited 1 (both victims failed so).
- ``start_workers``: the survivor's new workers wait in process-group start for the lost ranks; with
  the victim at group rank 0 they wait to reach a store host that is dead. The survivor's agent sees
  the member lost (``num_nodes_waiting``) and starts a new round. This passed on the old code too: it
  guards the phase (the victim at group rank 1 is test_rdzv_silent_node's second test).

The process group's timeout (600 s) is far above the test's deadlines: only the agent can end the waits
in time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agents import GLOO_JOB, Agent, child_env, read_jsonl, stop_leftovers, wait_for

pytestmark = [pytest.mark.torchrun, pytest.mark.etcd, pytest.mark.slow]

CONF = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
DEADLINE = 150  # generous for loaded cores; 4x below the process group's timeout


def agent(endpoint: str, run_id: str, out: Path, holds: Path, phase: str, name: str, steps: int) -> Agent:
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", CONF,
        "--max-restarts", "3", "--monitor-interval", "0.5",
        str(GLOO_JOB), "--out", str(out), "--steps", str(steps), "--step-time", "0.1", "--pg-timeout", "600",
    ]
    return Agent(cmd, out / f"{name}.log", env=child_env(ELASTIC_FT_AGENT_HOLD=f"{phase}:{holds}"))


def held(holds: Path, phase: str) -> dict[int, int]:
    """Agent pid -> its group rank, for every agent held at ``phase``."""
    found = {}
    for mark in holds.glob(f"{phase}.*"):
        if mark.suffix != ".tmp":
            record = json.loads(mark.read_text())
            found[record["pid"]] = record["group_rank"]
    return found


@pytest.mark.parametrize(
    "phase, victim_rank",
    [("assign_ranks", 0), ("assign_ranks", 1), ("start_workers", 0)],
    ids=["assign_ranks-victim-group-rank-0", "assign_ranks-victim-group-rank-1", "start_workers-victim-group-rank-0"],
)
def test_a_node_lost_after_its_round_completed_leaves_the_survivor_training(
    etcd, run_id, tmp_path, phase, victim_rank
):
    steps = 8
    holds = tmp_path / "holds"
    agents = [agent(etcd.endpoint, run_id, tmp_path, holds, phase, f"agent{i}", steps) for i in range(2)]
    try:
        ranks = wait_for(lambda: len(held(holds, phase)) == 2 and held(holds, phase), 180,
                         f"both agents held at {phase}", agents)
        victim = next(a for a in agents if ranks[a.pid] == victim_rank)
        survivor = next(a for a in agents if a is not victim)
        victim.kill_tree()
        (holds / "release").touch()
        wait_for(lambda: [s for s in read_jsonl(tmp_path / "steps.jsonl") if s["world_size"] == 1], DEADLINE,
                 "a step at world size 1 after the node was lost", [survivor])
        assert survivor.wait(timeout=DEADLINE) == 0, survivor.tail()
        if phase == "assign_ranks":  # the loss was met where the old code failed, and named
            assert "assigned their workers' ranks" in survivor.tail(200_000), survivor.tail()
    finally:
        stop_leftovers(agents)
    records = read_jsonl(tmp_path / "steps.jsonl")
    # No step ran in the doomed world of 2: the survivor trained every step alone.
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert {r["world_size"] for r in records} == {1}
    workers = read_jsonl(tmp_path / "workers.jsonl")
    assert {w["agent_pid"] for w in workers if w["world_size"] == 1} == {survivor.pid}
