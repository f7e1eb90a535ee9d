"""Chaos on the real stack: heterogeneous torchrun agents (1, 2 and 1 processes) on etcd3, file:// checkpoints.

Each test drives a sequence of node losses (the agent's process tree
SIGKILLed), container stops (SIGTERM to an agent), spot notices (served by the
node's local IMDS: the node commits and leaves with status 75), silent nodes
(the tree SIGSTOPped, killed once the others train again) and returns; after every
event the nodes still up must train again within a bound (a generous deadline
waited on, ``CHAOS_STALL_S``), and at the end: every sample consumed exactly
once (ledger), no corrupt checkpoint met on any resume, and the loss within
2e-3 (absolute, on ~5.0) of an uninterrupted run of the same spec and global
batch at world 1 (constant_global: the same samples and LR, so the same model
up to the order of float sums). The loss is compared at the first checkpoint
the whole world commits after the last node came back, not at the run's end:
the steps after it, at world 4 on 2 cores, would only add a minute per test
(the run's end after a restart is the whole-job test's, which trains to it).

The sequences that stalled on the code of issue 11 are fixed tests here:
a node killed, started again and killed again within seconds, and a whole
job lost and started again with the same command. The seeded random run is
``test_seeded_chaos``; ``scripts/chaos.sh`` runs it longer.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.handoff.leave_marker import RECLAIM_EXIT_CODE
from tests.chaos.cluster import Cluster, chaos_plan, stall_bound
from tests.e2e.conftest import train
from tests.waiting import wait_until

# While a node restarts (10-20 s of imports on 2 cores) the others train on, at up to 10 steps/s at world 1:
# the losses of a sequence must all come before the run's end.
STEPS = 160
# A sequence whose nodes are all down while they restart consumes no steps: after its checkpoint at step 5,
# 19 steps at world 4 (three checkpoints and the final one) check the resumed run as well as 155 do, in an
# eighth of the time (and its reference, trained in this process, is as short).
WHOLE_JOB_STEPS = 24


def overrides(steps: int = STEPS) -> list[str]:
    return [f"steps={steps}", "checkpoint.every_steps=5", "checkpoint.keep_last=null", "logging.ledger=true",
            "logging.every_steps=5"]


OVERRIDES = overrides()
LOSS_TOLERANCE = 2e-3
FINISH_S = 400

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.torchrun, pytest.mark.etcd]  # torchrun agents on etcd


@pytest.fixture
def cluster(etcd, tmp_path, request):
    """Three nodes (1, 2 and 1 processes) of a run of this test's own on the session's etcd."""
    c = Cluster(etcd.endpoint, request.node.name.replace("[", "-").rstrip("]"), tmp_path, [1, 2, 1], OVERRIDES)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> dict[int, dict[int, float]]:
    """Run length -> {step: loss} of the same spec and global batch trained without interruption (world 1,
    this process), filled by :func:`reference_of`: one run per length, for the whole module."""
    return {}


def reference_of(losses: dict[int, dict[int, float]], tmp_path_factory, steps: int = STEPS) -> dict[int, float]:
    """The loss at each step of the uninterrupted run of ``steps`` steps (the LR schedule depends on the length)."""
    if steps not in losses:
        root = str(tmp_path_factory.mktemp("reference"))
        assert train(root, "ref", *overrides(steps)) == 0
        from elastic_ft.runevents.events import read_events

        events = read_events(os.path.join(root, "ref", "logs", "events.jsonl"))
        losses[steps] = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
        assert sorted(losses[steps]) == list(range(1, steps + 1))
    return losses[steps]


@pytest.fixture
def reference_loss(reference_losses, tmp_path_factory) -> dict[int, float]:
    return reference_of(reference_losses, tmp_path_factory)


def start_all(c: Cluster) -> None:
    for node in c.nodes:
        c.start(node)
    wait_until(lambda: c.trained_since(0, steps=2), timeout=FINISH_S, what="the first steps", on_timeout=c.tails)


def trains_again(c: Cluster, since: float, what: str) -> None:
    """The nodes still up train again (a worker started after ``since`` finished a step), within the bound."""
    wait_until(lambda: c.trained_since(since) or c.finished(), timeout=stall_bound(),
               what=f"training again after {what}", on_timeout=c.tails)


def rejoined_and_committed(c: Cluster, since: float) -> tuple[int, int] | None:
    """(event index of the round, step) once a round of every node, started after ``since``, committed a
    checkpoint past the step it resumed from, with that step's loss and the ledger up to it logged; None before."""
    log = c.events()
    world = sum(node.nproc for node in c.nodes)
    first = next((i for i, e in enumerate(log) if e["event"] == "start" and e["ts"] > since and e["world"] == world),
                 None)
    if first is None:
        return None
    attempt = log[first]["attempt"]
    ours = [e for e in log[first:] if e.get("attempt") == attempt]
    resumed = next((e["step"] for e in ours if e["event"] == "resume_plan"), None)
    for e in ours:
        if e["event"] == "checkpoint_committed" and resumed is not None and e["step"] > resumed:
            step = e["step"]
            if (any(x["event"] == "step" and x["step"] == step for x in ours)
                    and any(x["event"] == "ledger" and x["step"] == step - 1 for x in ours)):
                return first, step
    return None


def finish(c: Cluster, reference: dict[int, float], steps: int = STEPS, *, to_end: bool = False) -> list[dict]:
    """Bring every node back; the run's exactness checks at the first checkpoint the whole world commits
    after that (or, ``to_end``, at the run's end; also where the run ended first)."""
    t = time.time()
    for node in c.nodes:
        if not node.running:
            c.start(node)
    if to_end:
        wait_until(c.finished, timeout=FINISH_S, what="the end of the run", interval=1, on_timeout=c.tails)
        upto = steps
    else:
        found = wait_until(lambda: rejoined_and_committed(c, t) or c.finished(), timeout=FINISH_S, interval=0.5,
                           what="a checkpoint of the world of every node", on_timeout=c.tails)
        upto = steps if found is True else found[1]
    events = c.events()
    plans = [e for e in events if e["event"] == "resume_plan"]
    assert all(p["skipped"] == [] for p in plans), [p["skipped"] for p in plans]  # no torn checkpoint met
    assert not [e for e in events if e["event"] == "resume_failed"]
    history = replay(events)
    ended = upto == steps
    assert (sorted(history) if ended else sorted(history)[:upto]) == list(range(upto)), sorted(history)
    assert check_exactly_once(history, 1024) == []
    # The newest attempt's loss at that step (an earlier attempt may have logged it before a rollback).
    final = next(e for e in reversed(events) if e["event"] == "step" and e["step"] == upto)
    assert math.isclose(final["loss"], reference[upto], abs_tol=LOSS_TOLERANCE), (upto, final["loss"],
                                                                                   reference[upto])
    return events


def test_node_killed_restarted_and_killed_again_within_seconds(cluster, reference_loss):
    c = cluster
    start_all(c)
    victim = c.nodes[2]
    c.kill(victim)
    c.start(victim)
    # Killed again once its new round completed, before its workers could join the process group.
    wait_until(lambda: "Rendezvous complete" in victim.agent.tail(200_000), timeout=stall_bound(),
               what="the rejoin round", on_timeout=c.tails)
    c.kill(victim)
    trains_again(c, time.time(), "the second kill")
    finish(c, reference_loss)


def test_whole_job_lost_and_started_again_with_the_same_command_then_again_once_finished(
        cluster, reference_losses, tmp_path_factory):
    """The same command again, twice: after the whole job was lost it resumes; after the job finished it exits
    finished (the completed job's rendezvous is reopened). One run for both: each needs a whole run first."""
    c = cluster
    # Trained before the cluster starts: finish() would start again nodes that ended meanwhile.
    reference = reference_of(reference_losses, tmp_path_factory, WHOLE_JOB_STEPS)
    c.overrides = overrides(WHOLE_JOB_STEPS)  # before any node starts: every command of the run has them
    start_all(c)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in c.events()), timeout=FINISH_S,
               what="a checkpoint", on_timeout=c.tails)
    for node in c.nodes:
        c.kill(node)
    t = time.time()
    for node in c.nodes:
        c.start(node)
    trains_again(c, t, "the whole job's restart")
    events = finish(c, reference, WHOLE_JOB_STEPS, to_end=True)
    assert [e for e in events if e["event"] == "resume_plan"][-1]["step"] > 0
    # Every node is new after a whole-job loss: no kept step survives it, the first resume reads the store.
    first = next(e for e in events if e["event"] == "resume_plan" and e["ts"] > t)
    assert first["origin"] == "checkpoint" and first["step"] > 0 and first["source"], first
    for node in c.nodes:
        assert node.agent.wait(120) == 0, node.agent.tail()
    for node in c.nodes:  # the same command again: the rendezvous of the completed job is reopened
        c.start(node)
    for node in c.nodes:
        assert node.agent.wait(FINISH_S) == 0, node.agent.tail()
    assert c.events()[-1]["event"] == "end"


def run_seeded(c: Cluster, reference: dict[int, float], seed: int, count: int) -> None:
    start_all(c)
    for action, index in chaos_plan(seed, count, len(c.nodes)):
        node = c.nodes[index]
        t = time.time()
        if action == "kill":
            c.kill(node)
        elif action == "sigterm":
            c.sigterm(node, timeout=60)
        elif action == "notice":
            assert c.notice(node, timeout=stall_bound()) == RECLAIM_EXIT_CODE, node.agent.tail()
        elif action == "silent":
            c.silence(node)
        else:
            c.start(node)
        trains_again(c, t, f"{action} of {node.name} (seed {seed})")
        if action == "silent":
            c.kill(node)  # the survivors went on without it: now the machine is gone for good
    finish(c, reference)


def test_seeded_chaos(cluster, reference_loss):
    # Seed 33: SIGTERM, notice, two returns, silent, kill (every kind of loss; world 4 → 3 → 1 → 3 → 4 → 2 → 1).
    run_seeded(cluster, reference_loss, seed=int(os.environ.get("CHAOS_SEED", "33")), count=6)


@pytest.mark.skipif("CHAOS_EVENTS" not in os.environ, reason="the long run: scripts/chaos.sh sets CHAOS_EVENTS")
def test_seeded_chaos_longer(cluster, reference_loss):
    run_seeded(cluster, reference_loss, seed=int(os.environ.get("CHAOS_SEED", "7")),
               count=int(os.environ.get("CHAOS_EVENTS", "8")))
