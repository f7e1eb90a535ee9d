"""A node of a running two-node job (torchrun agents on etcd3, nproc 1 and 2) leaves on a spot notice.

Each node has its own local IMDS. The node told to go commits the step the
notice interrupted, its agent leaves the rendezvous without restarting its
workers and exits with the reclaim status (75); the other node goes on at the
smaller world from the next step. The heartbeat of a node is declared stale
only after ``keep_alive_interval * keep_alive_max_attempt`` = 1000 s here, far
beyond the test's bounds: the survivor finishing at all proves that it did not
wait for the gone node's keep-alive to expire. No agent may restart its
workers after a failure (``--max-restarts 0``): a leave, a join and a return
are changes of membership, not failures. Run again with the same
command, the node joins the job again (its workers committing the current
step for the join); told to go, both nodes leave (in one round or two). The ledger shows every
sample learned exactly once. The SIGTERM test keeps its checkpoints on a real
S3 server (SeaweedFS), the other in a local directory.
"""

from __future__ import annotations

import datetime
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.spot.imds import ENDPOINT_ENV
from elastic_ft.handoff.leave_marker import RECLAIM_EXIT_CODE
from tests.checkpoint.s3_servers import aws_env
from tests.conftest import DEFAULT_SPEC
from tests.rendezvous.agents import Agent, child_env, stop_leftovers, wait_for
from tests.rendezvous.etcd_server import EtcdServer
from tests.spot.imds_server import FakeImds

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torchrun,
    pytest.mark.etcd,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (scripts/setup.sh --test)"),
]

WAIT_S = 240.0  # generous bounds: CI's 2 cores are loaded
# A stale heartbeat only after 1000 s: nothing here may wait for one.
CONF = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=1000"
# The notice test's last call: far longer than a round after a leave on a notice may take (it closes
# once the node that stays is in, elastic_ft.rendezvous.spot_leave); the other rounds there reach max_nodes.
LONG_LAST_CALL_S = 30
LEAVE_ACTIONS = ("checkpoint_and_leave", "flush_and_leave")


def in_two_minutes() -> str:
    when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def imds_pair():
    servers = [FakeImds().start(), FakeImds().start()]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


class Job:
    """Two nodes (nproc 1 and 2) of one run on etcd3, each with its own IMDS."""

    def __init__(self, etcd: EtcdServer, tmp: Path, imds: list[FakeImds], steps: int, s3=None,
                 conf: str = CONF) -> None:
        self.etcd, self.tmp, self.imds, self.steps, self.conf = etcd, tmp, imds, steps, conf
        self.run_id = tmp.name[-60:].strip("-_.") or "leave"
        # Checkpoints in a local directory, or on the S3 server ``s3`` (an S3Endpoint) when given.
        self.checkpoint_uri = f"file://{tmp}/runs" if s3 is None else f"s3://{s3.bucket}/jobs/{self.run_id}"
        self.s3 = s3
        self.events_path = tmp / "logs" / "events.jsonl"
        self.agents = [self.node(nproc, server, f"node{nproc}") for nproc, server in zip((1, 2), imds)]

    def node(self, nproc: int, imds: FakeImds, name: str) -> Agent:
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            "--nnodes", "1:2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "etcd3", "--rdzv-endpoint", self.etcd.endpoint, "--rdzv-id", self.run_id,
            "--rdzv-conf", self.conf, "--max-restarts", "0", "--monitor-interval", "0.5",
            "-m", "elastic_ft.worker", "--spec", DEFAULT_SPEC, "--run_id", self.run_id,
            "--checkpoint_uri", self.checkpoint_uri, "--log_dir", str(self.tmp / "logs"),
            f"steps={self.steps}", "checkpoint.every_steps=10", "checkpoint.keep_last=null",
            "logging.ledger=true", "logging.every_steps=1", "spot.poll_interval_s=0.1", "spot.imds_timeout_s=5",
        ]
        env = child_env(**{ENDPOINT_ENV: imds.url})
        if self.s3 is not None:
            env = aws_env(env, self.s3, str(self.tmp))
        return Agent(cmd, self.tmp / f"{name}.log", env=env)

    def events(self) -> list[dict]:
        return read_events(str(self.events_path)) if self.events_path.exists() else []

    def training_at(self, world: int, after: int = 0) -> dict | None:
        """The newest start at ``world`` (after event index ``after``), once it has trained a step."""
        log = self.events()
        starts = [i for i, e in enumerate(log) if i >= after and e["event"] == "start" and e["world"] == world]
        if starts and any(e["event"] == "step" for e in log[starts[-1]:]):
            return log[starts[-1]]
        return None

    def holder_of_rank0(self, start: dict) -> tuple[int, Agent, Agent]:
        """(index, agent) of the node whose worker holds rank 0 in ``start``'s world, and the other one."""
        i = next(i for i, a in enumerate(self.agents) if start["pid"] in a.descendants())
        return i, self.agents[i], self.agents[1 - i]


def check_left_and_resumed(job: Job, kind: str, victim: int) -> tuple[int, int]:
    """One leave at step S (committed, the newest), then the survivor's world resumed at S; (S, event index)."""
    log = job.events()
    decisions = [e for e in log if e["event"] == "spot_decision" and e["notice"] == kind]
    # One decision: the node that left did not come back in a new round and leave again.
    assert [d["action"] for d in decisions] in ([a] for a in LEAVE_ACTIONS), decisions
    left_at = decisions[0]["step"]
    i_pre, preempted = next((i, e) for i, e in enumerate(log) if e["event"] == "preempted")
    assert preempted["step"] == left_at and len(preempted["leaving_nodes"]) == 1, preempted
    i_resume, resume = next((i, e) for i, e in enumerate(log) if i > i_pre and e["event"] == "resume_plan")
    committed = [e["step"] for e in log[:i_resume] if e["event"] == "checkpoint_committed"]
    assert max(committed) == left_at, "the step the notice interrupted was not the newest committed"
    assert resume["step"] == left_at, resume
    survivor_world = 3 - (victim + 1)  # the nproc of the node that stayed
    assert [e["world"] for e in log[i_pre:] if e["event"] == "start"][0] == survivor_world
    # The survivors' one line says the node left on the notice, not that it crashed.
    lost = next(e for e in log[i_pre:] if e["event"] == "node_lost")
    assert f"left on a spot {kind} notice, step {left_at} committed" in lost["reason"], lost
    trained = [e["step"] for e in log[i_resume:] if e["event"] == "ledger"]
    assert trained[0] == left_at, "the first step trained after the leave is not the one after the commit"
    return left_at, i_resume


_AGENT_LINE = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*agent/server/api\.py:\d+\] \[[^\]]*\] "
                         r"(Rendezvous'ing worker group|Rendezvous complete for workers)")


def rendezvous_seconds(agent_log: str) -> list[float]:
    """Seconds each round of a torchrun agent took, from its log (its own timestamps)."""
    out, began = [], None
    for line in agent_log.splitlines():
        m = _AGENT_LINE.match(line)
        if m:
            h, mi, sec, what = m.groups()
            t = int(h) * 3600 + int(mi) * 60 + float(sec)
            if what.startswith("Rendezvous'ing"):
                began = t
            elif began is not None:
                out.append((t - began) % 86400)
                began = None
    return out


def check_exactly_once_to_the_end(job: Job) -> None:
    log = job.events()
    history = replay(log)
    assert sorted(history) == list(range(job.steps))
    assert check_exactly_once(history, 1024) == []
    assert log[-1]["event"] == "end" and log[-1]["step"] == job.steps


def test_terminate_notice_node_leaves_survivor_goes_on_and_the_node_rejoins(etcd, imds_pair, tmp_path):
    # Far more steps than the test runs (it ends with a notice to both nodes):
    # the job must still run when the node, started again, joins.
    conf = CONF.replace("last_call_timeout=2", f"last_call_timeout={LONG_LAST_CALL_S}")
    job = Job(etcd, tmp_path, imds_pair, steps=5000, conf=conf)
    try:
        start = wait_for(lambda: job.training_at(3), WAIT_S, "a step at world size 3", job.agents)
        victim_i, victim, survivor = job.holder_of_rank0(start)  # the leader leaves: the harder case
        job.imds[victim_i].set_instance_action({"action": "terminate", "time": in_two_minutes()})
        code = victim.wait(timeout=WAIT_S)
        assert code == RECLAIM_EXIT_CODE, victim.tail()
        assert "leaves rendezvous" in victim.tail(20000), victim.tail()
        wait_for(lambda: job.training_at(3 - (victim_i + 1)), WAIT_S, "the survivor training alone", [survivor])
        left_at, i_resume = check_left_and_resumed(job, "terminate", victim_i)
        rounds = rendezvous_seconds(survivor.tail(200000))
        assert len(rounds) == 2 and rounds[1] < LONG_LAST_CALL_S / 2, (
            f"the survivor's rounds took {rounds} s: after the leave it waited for the last call")

        # A new instance in its place: no notice, the same command. It joins; the
        # survivor's workers commit the current step for the join (SIGTERM from their agent).
        job.imds[victim_i].set_instance_action(None)
        back = job.node(victim_i + 1, job.imds[victim_i], f"node{victim_i + 1}-again")
        job.agents.append(back)
        wait_for(lambda: job.training_at(3, after=i_resume), WAIT_S, "a step at world size 3 again",
                 [survivor, back])
        # Then both nodes are told to go: both leave, and the job is safe to submit again.
        for server in job.imds:
            server.set_instance_action({"action": "terminate", "time": in_two_minutes()})
        for agent in (survivor, back):
            assert agent.wait(timeout=WAIT_S) == RECLAIM_EXIT_CODE, agent.tail()
    finally:
        stop_leftovers(job.agents)

    log = job.events()
    i_join = next(i for i, e in enumerate(log) if i > i_resume and e["event"] == "resume_plan")
    joins = [e for e in log[i_resume:i_join] if e["event"] == "spot_decision"]
    assert [(d["notice"], d["action"]) for d in joins] in (
        [("sigterm", a)] for a in LEAVE_ACTIONS), "the join's stop was not answered with a commit"
    joined_at = joins[0]["step"]
    assert log[i_join]["step"] == joined_at > left_at
    assert max(e["step"] for e in log[:i_join] if e["event"] == "checkpoint_committed") == joined_at
    assert [e["step"] for e in log[i_join:] if e["event"] == "ledger"][0] == joined_at
    assert [e["world"] for e in log[:i_join] if e["event"] == "start"][-1] == 3  # a start precedes its plan
    # One node may see its notice a poll later than the other, and leave a round later.
    ends = [e for e in log[i_join:] if e["event"] == "spot_decision"]
    assert ends and {(e["notice"], e["action"] in LEAVE_ACTIONS) for e in ends} == {("terminate", True)}, ends
    last = [e for e in log if e["event"] == "preempted"][-1]
    assert last["step"] > joined_at
    assert max(e["step"] for e in log if e["event"] == "checkpoint_committed") == last["step"]
    history = replay(log)
    assert sorted(history) == list(range(last["step"]))
    assert check_exactly_once(history, 1024) == []


def test_sigterm_to_a_node_agent_node_leaves_survivor_goes_on(etcd, imds_pair, seaweed, tmp_path):
    """Checkpoints on a real S3 server: the leave's commit and the survivor's resume go through S3."""
    # The SIGTERM comes at the first step at world 3 (step 5 or so): 100 steps leave the survivor's world
    # most of the run to resume and train in; more would only add steps at world 1 or 2.
    job = Job(etcd, tmp_path, imds_pair, steps=100, s3=seaweed)
    try:
        start = wait_for(lambda: job.training_at(3), WAIT_S, "a step at world size 3", job.agents)
        victim_i, victim, survivor = job.holder_of_rank0(start)
        victim.process.send_signal(signal.SIGTERM)  # a container stop (Batch TerminateJob)
        code = victim.wait(timeout=WAIT_S)
        assert code == RECLAIM_EXIT_CODE, victim.tail()
        assert "leaves rendezvous" in victim.tail(20000), victim.tail()
        assert "SIGKILL" not in victim.tail(20000), victim.tail()
        assert survivor.wait(timeout=WAIT_S) == 0, survivor.tail()
    finally:
        stop_leftovers(job.agents)
    check_left_and_resumed(job, "sigterm", victim_i)
    check_exactly_once_to_the_end(job)
    committed = [e for e in job.events() if e["event"] == "checkpoint_committed"]
    assert committed and all(e["key"].startswith(job.checkpoint_uri) for e in committed), committed[:2]
