"""A node lost between two commits costs at most the step in flight: the survivor resumes from the step it kept.

Two torchrun agents (one process each) on etcd3 train the tiny spec with
``checkpoint.every_steps`` far beyond the run, so nothing is committed before the
loss; one node's whole process tree is SIGKILLed after a few steps. The survivor's
agent restarts its worker, which finds the step its node kept in shared memory
(:mod:`elastic_ft.train.kept_state`): the resume event names the source (memory,
the holder, the step), at most one completed step is trained twice, the resumed
step is committed right after, the ledger holds every sample exactly once, and the
loss at the end equals an uninterrupted run's. On the code before keeping, the
survivor restarted from step 0 (no commit): this test fails there.
"""

from __future__ import annotations

import math
import os

import pytest

from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.train import kept_files
from elastic_ft.warm import protocol as warm_protocol
from tests.chaos.cluster import Cluster, stall_bound
from tests.e2e.conftest import train
from tests.waiting import wait_until

STEPS = 24
OVERRIDES = [f"steps={STEPS}", "checkpoint.every_steps=100000", "checkpoint.keep_last=null", "logging.ledger=true",
             "logging.every_steps=5"]
LOSS_TOLERANCE = 2e-3  # the chaos tests' (absolute, on ~5.0): the same samples and LR, float sums reordered
FINISH_S = 400

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.torchrun, pytest.mark.etcd]


@pytest.fixture
def cluster(etcd, tmp_path, request):
    c = Cluster(etcd.endpoint, f"kept-{os.getpid()}-{request.node.name}"[:60], tmp_path, [1, 1], OVERRIDES)
    try:
        yield c
    finally:
        c.stop_all()


def reference_loss(tmp_path_factory) -> float:
    """The loss at the last step of the same spec and global batch trained without interruption (world 1)."""
    root = str(tmp_path_factory.mktemp("reference"))
    assert train(root, "ref", *OVERRIDES) == 0
    events = read_events(os.path.join(root, "ref", "logs", "events.jsonl"))
    return next(e["loss"] for e in events if e["event"] == "step" and e["step"] == STEPS)


def test_node_killed_between_commits_survivor_resumes_from_its_kept_step(cluster, tmp_path_factory):
    c = cluster
    for node in c.nodes:
        c.start(node)

    def trained_at_world_2(steps: int) -> bool:
        log = c.events()
        first = next((i for i, e in enumerate(log) if e["event"] == "start" and e["world"] == 2), None)
        return first is not None and sum(e["event"] == "step_done" for e in log[first:]) >= steps

    wait_until(lambda: trained_at_world_2(6), timeout=FINISH_S, what="six steps at world 2", interval=0.2,
               on_timeout=c.tails)
    c.kill(c.nodes[1])
    wait_until(lambda: any(e["event"] == "resume_plan" and e["step"] > 0 for e in c.events()) or c.finished(),
               timeout=stall_bound(), what="the survivor's resume", on_timeout=c.tails)
    if c.nodes[0].running:
        # The survivor's restarted workers were forked by the warm process its agent started for the first
        # round: the lost-node note of the new round is no reason for another one (which imports it all again).
        assert (warm_dir := warm_protocol.private_dir()) is not None
        socks = [f for f in os.listdir(warm_dir)
                 if f.startswith(f"{c.nodes[0].agent.pid}-") and f.endswith(".sock")]
        assert len(socks) == 1, socks
    wait_until(c.finished, timeout=FINISH_S, what="the end of the run", interval=1, on_timeout=c.tails)

    events = c.events()
    plans = [(i, e) for i, e in enumerate(events) if e["event"] == "resume_plan"]
    assert len(plans) == 2, [p for _, p in plans]
    at, plan = plans[1]
    before = events[:at]
    last_done = max(e["step"] for e in before if e["event"] == "step_done")
    assert not [e for e in before if e["event"] == "checkpoint_committed"]  # nothing committed: memory or step 0
    assert plan["origin"] == "memory", plan
    assert plan["holder"]["node"] in (0, 1) and plan["holder"]["step"] == plan["step"], plan
    assert plan["source"] is None and "kept in memory" in plan["reason"], plan  # no manifest was read
    # At most the step in flight and one completed step (whose write the kill may have cut) are trained again.
    assert last_done - 1 <= plan["step"] <= last_done + 1, (last_done, plan)
    after = events[at:]
    assert any(e["event"] == "checkpoint_committed" and e["step"] == plan["step"]
               and e["reason"] == "resumed from memory" for e in after), [e for e in after if "checkpoint" in e["event"]]

    # Every step's events are in the log once the run ends: those of the steps since the last commit, which
    # the lost leader may have taken along, are carried by the kept step and written again.
    for name in ("step", "step_done"):
        assert sorted({e["step"] for e in events if e["event"] == name}) == list(range(1, STEPS + 1)), name
    history = replay(events)
    assert sorted(history) == list(range(STEPS))
    assert check_exactly_once(history, 1024) == []
    final = next(e for e in reversed(events) if e["event"] == "step" and e["step"] == STEPS)
    expected = reference_loss(tmp_path_factory)
    assert math.isclose(final["loss"], expected, abs_tol=LOSS_TOLERANCE), (final["loss"], expected)

    # The run ended normally: the survivor removed its kept files, and the lost node's (its agent gone) went at
    # the survivor's restart.
    mine = kept_files.kept_name(c.run_id, "")
    assert not [f for f in os.listdir(kept_files.kept_dir()) if f.startswith(mine)]


JOIN_STEPS = 60  # the replacement's agent must join while the survivor still trains (at up to 15 steps/s alone)
JOIN_OVERRIDES = [f"steps={JOIN_STEPS}", *OVERRIDES[1:]]


def test_a_replacement_node_gets_the_kept_step_from_the_survivor_not_from_the_store(etcd, tmp_path, request):
    """A node killed and a new one started in its place at once: every resume after the loss is from the survivor's
    memory (no manifest named: no rank read a checkpoint), the world of both nodes included, so the new node's
    state came over the process group; the run ends with every sample once."""
    c = Cluster(etcd.endpoint, f"kept-join-{os.getpid()}", tmp_path, [1, 1], JOIN_OVERRIDES)
    try:
        for node in c.nodes:
            c.start(node)
        wait_until(lambda: c.progress() >= 6, timeout=FINISH_S, what="six steps", interval=0.2, on_timeout=c.tails)
        c.kill(c.nodes[1])
        c.start(c.nodes[1])  # a replacement machine
        wait_until(c.finished, timeout=FINISH_S, what="the end of the run", interval=1, on_timeout=c.tails)
        events = c.events()
    finally:
        c.stop_all()
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    plans = [e for e in events if e["event"] == "resume_plan"]
    assert len(plans) == len(starts) >= 2
    assert all(p["origin"] == "memory" and p["source"] is None for p in plans[1:]), plans[1:]
    assert events[starts[-1]]["world"] == 2, [events[i]["world"] for i in starts]  # the replacement took part
    assert not [e for e in events[:starts[1]] if e["event"] == "checkpoint_committed"]
    history = replay(events)
    assert sorted(history) == list(range(JOIN_STEPS)) and check_exactly_once(history, 1024) == []
    for name in ("step", "step_done"):
        assert sorted({e["step"] for e in events if e["event"] == name}) == list(range(1, JOIN_STEPS + 1)), name
