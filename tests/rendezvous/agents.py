"""Node agents for the multi-node tests: torchrun (or torchx) processes on this machine.

An :class:`Agent` is one simulated node: a ``torchrun --rdzv-backend=etcd3``
process with its own log file. A lost node is simulated by killing the agent's
whole process tree: torchrun's workers run in their own session, so killing
the agent alone would leave them training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import psutil

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
GLOO_JOB = Path(__file__).with_name("gloo_job.py")


def child_env(**extra: str) -> dict[str, str]:
    """The agents' environment: the venv first on PATH, INFO logs, no inherited knobs.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE is removed on purpose: a plain torchrun
    in a fresh shell must work.
    """
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "INFO"
    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "ELASTIC_FT_FAULTS", "ELASTIC_FT_AGENT_HOLD"):
        env.pop(name, None)
    env.update(extra)
    return env


class Agent:
    """One node: a process (tree) started with ``cmd``, logging to ``log``."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                cmd, cwd=REPO, env=env or child_env(), stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.pid} did not exit within {timeout} s; log tail:\n{self.tail()}"
            ) from None

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "<no log>"

    def kill_tree(self) -> None:
        """SIGKILL the agent and every descendant (its workers), like a lost machine."""
        try:
            root = psutil.Process(self.pid)
            procs = root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        self.process.wait(timeout=30)

    def stop_tree(self) -> None:
        """SIGSTOP the agent and every descendant: a silent node (no exit, no TCP reset, no heartbeat).

        ``kill_tree`` ends a stopped tree too (SIGKILL needs no SIGCONT).
        """
        root = psutil.Process(self.pid)
        for p in [root] + root.children(recursive=True):
            p.send_signal(signal.SIGSTOP)

    def descendants(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def stop_leftovers(agents: list[Agent]) -> None:
    """Kill every agent still running (a test's ``finally``: nothing outlives it)."""
    for agent in agents:
        if agent.poll() is None:
            agent.kill_tree()


def split_at_rank(agents: list[Agent], workers: list[dict], rank_test) -> tuple[Agent, list[Agent]]:  # type: ignore[no-untyped-def]
    """The agent whose worker's rank passes ``rank_test`` (``workers``: one world's records), and the others."""
    pid = next(w["agent_pid"] for w in workers if rank_test(w["rank"]))
    chosen = next(a for a in agents if a.pid == pid)
    return chosen, [a for a in agents if a is not chosen]


def lose_node(victim: Agent, survivors: list[Agent], timeout: float,
              observe: Callable[[], object] = lambda: None) -> object:
    """Kill ``victim``'s whole process tree, like a lost machine; every survivor must finish with 0.

    ``observe`` runs right after the kill, before the survivors finish, and its
    result is returned: what a test reads there cannot change by the victim.
    """
    victim.kill_tree()
    seen = observe()
    for agent in survivors:
        assert agent.wait(timeout=timeout) == 0, agent.tail()
    return seen


def torchrun_agent(
    endpoint: str,
    run_id: str,
    out: Path,
    *,
    nproc: int,
    nnodes: str,
    steps: int,
    step_time: float = 0.2,
    max_restarts: int = 3,
    # A 1 s heartbeat lets survivors drop a dead node after 3 s instead of 15 s.
    conf: str = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1",
    name: str = "agent",
    job_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Agent:
    """A plain ``torchrun --rdzv-backend=etcd3`` agent running the gloo test job
    (``job_args``: more options of gloo_job.py; ``env``: the agent's environment, default :func:`child_env`)."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nnodes", nnodes,
        "--nproc-per-node", str(nproc),
        "--rdzv-backend", "etcd3",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        "--rdzv-conf", conf,
        "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.5",
        str(GLOO_JOB), "--out", str(out), "--steps", str(steps), "--step-time", str(step_time),
        *job_args,
    ]
    return Agent(cmd, out / f"{name}.log", env=env)


def read_jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    # The last line may be half-written while a process appends it.
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def wait_for(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    agents: list[Agent] = (),  # type: ignore[assignment]
    poll: float = 0.2,
) -> object:
    """:func:`tests.waiting.wait_until` that fails as soon as one of ``agents`` exits, with the agents' log tails."""

    def running() -> None:
        for agent in agents:
            if agent.poll() is not None:
                raise AssertionError(
                    f"agent {agent.pid} exited with {agent.poll()} while waiting for {what}; "
                    f"log tail:\n{agent.tail()}"
                )

    return wait_until(condition, timeout=timeout, what=what, interval=poll, check=running,
                      on_timeout=lambda: "\n".join(f"--- agent {a.pid}\n{a.tail(2000)}" for a in agents))


def rendezvous_state_of(backend):  # type: ignore[no-untyped-def]
    """The rendezvous state a backend holds in the test's own etcd, or None.

    The state is torch's pickled ``_RendezvousState``, loaded as the handler's
    type check loads it: only the state's own types are resolved.
    """
    from elastic_ft.rendezvous.state_codec import load_state

    got = backend.get_state()
    return None if got is None else load_state(got[0])
