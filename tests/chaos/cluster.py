"""A chaos cluster: heterogeneous trainer nodes (torchrun agents on etcd3) that a driver kills, stops and restarts.

Shared by tests/chaos/ and scripts/chaos.sh. A node is one torchrun agent
running the real trainer, with its own local IMDS (a spot notice is served
there); every node of a cluster uses the same command, so a node started
again is the same node coming back. The run's leader writes the
events every check reads (``events.jsonl``: ``start``, ``step_done``,
``resume_plan``, ``checkpoint_committed``, ``end``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
import time
from pathlib import Path

from elastic_ft.runevents.events import read_events
from elastic_ft.spot.imds import ENDPOINT_ENV
from tests import waiting
from tests.conftest import DEFAULT_SPEC
from tests.rendezvous.agents import Agent, child_env
from tests.spot.imds_server import FakeImds

# One-second heartbeats: a lost node is dropped after 3 s; rounds close 2 s after the last join.
RDZV_CONF = "last_call_timeout=2,join_timeout=300,keep_alive_interval=1"


@dataclasses.dataclass
class Node:
    name: str
    nproc: int
    agent: Agent | None = None
    starts: int = 0
    imds: FakeImds | None = None

    @property
    def running(self) -> bool:
        return self.agent is not None and self.agent.poll() is None


class Cluster:
    """Nodes of one run (``run_id``) on the etcd at ``endpoint``, checkpoints and logs under ``root``."""

    def __init__(self, endpoint: str, run_id: str, root: Path, nprocs: list[int], overrides: list[str]) -> None:
        self.endpoint, self.run_id, self.root = endpoint, run_id, root
        self.overrides = overrides
        self.nodes = [Node(f"node{i}", n) for i, n in enumerate(nprocs)]
        self.events_path = root / "logs" / "events.jsonl"

    def command(self, node: Node) -> list[str]:
        return [
            str(Path(sys.executable).parent / "torchrun"),
            "--nnodes", f"1:{len(self.nodes)}", "--nproc-per-node", str(node.nproc),
            "--rdzv-backend", "etcd3", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
            "--rdzv-conf", RDZV_CONF, "--max-restarts", "1000", "--monitor-interval", "0.5",
            "-m", "elastic_ft.worker", "--spec", DEFAULT_SPEC, "--run_id", self.run_id,
            "--checkpoint_uri", f"file://{self.root}/runs", "--log_dir", str(self.root / "logs"),
            *self.overrides,
        ]

    def start(self, node: Node) -> None:
        assert not node.running, f"{node.name} is running"
        node.starts += 1
        if node.imds is None:
            node.imds = FakeImds().start()
        node.imds.set_instance_action(None)  # a new instance in the reclaimed one's place
        env = child_env(**{ENDPOINT_ENV: node.imds.url})
        node.agent = Agent(self.command(node), self.root / f"{node.name}.{node.starts}.log", env=env)

    def kill(self, node: Node) -> None:
        """A lost machine: the agent's whole process tree SIGKILLed."""
        if node.agent is not None:
            node.agent.kill_tree()

    def sigterm(self, node: Node, timeout: float) -> int:
        """A container stop: SIGTERM to the agent (it forwards it to its workers); its exit status."""
        assert node.agent is not None
        node.agent.process.send_signal(signal.SIGTERM)
        try:
            return node.agent.wait(timeout)
        except AssertionError:
            node.agent.kill_tree()  # torchrun's own 30 s SIGKILL did not end it: report, leave nothing behind
            raise

    def serve_notice(self, node: Node) -> None:
        """A spot terminate notice (two minutes ahead) served by the node's IMDS."""
        assert node.imds is not None
        when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
        node.imds.set_instance_action({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")})

    def notice(self, node: Node, timeout: float) -> int:
        """A spot notice to ``node``; its agent's exit status once it left."""
        assert node.agent is not None
        self.serve_notice(node)
        try:
            return node.agent.wait(timeout)
        except AssertionError:
            node.agent.kill_tree()
            raise

    def silence(self, node: Node) -> None:
        """A node that goes silent (no TCP reset): its whole process tree SIGSTOPped."""
        if node.agent is not None:
            node.agent.stop_tree()

    def stop_all(self) -> None:
        for node in self.nodes:
            if node.running:
                node.agent.kill_tree()
            if node.imds is not None:
                node.imds.stop()
                node.imds = None

    def events(self) -> list[dict]:
        return read_events(str(self.events_path)) if self.events_path.exists() else []

    def trained_since(self, t: float, *, steps: int = 1) -> dict | None:
        """The ``steps``-th step finished by a worker started after wall time ``t``, or None."""
        log = self.events()
        first = next((i for i, e in enumerate(log) if e["event"] == "start" and e["ts"] > t), None)
        if first is None:
            return None
        done = [e for e in log[first:] if e["event"] == "step_done"]
        return done[steps - 1] if len(done) >= steps else None

    def finished(self) -> bool:
        log = self.events()
        return bool(log) and log[-1]["event"] == "end"

    def progress(self) -> int:
        """The newest step finished so far (0 before any)."""
        return max((e["step"] for e in self.events() if e["event"] == "step_done"), default=0)

    def tails(self) -> str:
        return "\n".join(f"--- {n.name} ({n.agent.log.name})\n{n.agent.tail(3000)}" for n in self.nodes
                         if n.agent is not None)


def wait_until(condition, timeout: float, what: str, cluster: Cluster, poll: float = 0.25):
    """:func:`tests.waiting.wait_until` failing with the nodes' log tails (bench/preemption.py calls it too)."""
    return waiting.wait_until(condition, timeout=timeout, what=what, interval=poll, on_timeout=cluster.tails)


def stall_bound() -> float:
    """Seconds the surviving nodes may take to train again after an event (CHAOS_STALL_S; generous for CI)."""
    return float(os.environ.get("CHAOS_STALL_S", "150"))


LOSSES = ("kill", "sigterm", "notice", "silent")
"""How a node goes: hard kill, container stop (SIGTERM), spot notice from IMDS, silence (SIGSTOP)."""
ACTIONS = (*LOSSES, "restart")


def chaos_plan(seed: int, count: int, nodes: int) -> list[tuple[str, int]]:
    """A seeded sequence of ``count`` (action, node index) events; pure, so a seed names one sequence.

    At least one node always stays up (a loss picks a running node only
    while another one runs); ``restart`` brings back a stopped node;
    when every node runs the next event takes one down, and when only one
    runs the next brings one back. So the world changes at every event.
    """
    import random

    rng = random.Random(seed)
    up = set(range(nodes))
    out = []
    for _ in range(count):
        down = sorted(set(range(nodes)) - up)
        if len(up) > 1 and (not down or rng.random() < 0.6):
            action, node = rng.choice(LOSSES), rng.choice(sorted(up))
            up.discard(node)
        else:
            action, node = "restart", rng.choice(down)
            up.add(node)
        out.append((action, node))
    return out
