"""Warm starts (elastic_ft.warm) with real processes: a stand-in agent (tests/warm/agent.py) starts launchers
of a probe worker (tests/warm/probe.py) as torchrun starts workers; the probe prints what its process is."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.conftest import REPO, process_env
from tests.waiting import wait_until

pytestmark = pytest.mark.subprocess

PROBE = [sys.executable, "-m", "tests.warm.probe"]


@pytest.fixture
def runtime_dir():
    # Short: a Unix socket's path must stay under 108 bytes (pytest's tmp_path is long).
    path = tempfile.mkdtemp(prefix="eftw", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Agent:
    def __init__(self, commands: list[list[str]], runtime_dir: str, *, hold: bool = True, cwd: str = REPO,
                 **env: str) -> None:
        argv = [] if hold else ["--no-hold"]
        for i, cmd in enumerate(commands):
            argv += (["--"] if i else []) + cmd
        # TORCHELASTIC_RUN_ID: as torchrun sets it for its workers (warm starts are for those only).
        self.env = process_env(XDG_RUNTIME_DIR=runtime_dir, PYTHONPATH=REPO, TORCHELASTIC_RUN_ID="stand-in", **env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm.agent", *argv],
                                     cwd=cwd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=0)
        self.lines: list[str] = []
        self.pending = b""

    def line(self, predicate, timeout: float = 60) -> str:
        """The first line of the agent's (and its workers') stdout that passes ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if predicate(line):
                    self.lines.remove(line)
                    return line
            left = deadline - time.monotonic()
            # Raw reads: a buffered readline would keep the next lines where select does not see them.
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"no such line within {timeout} s; seen: {self.lines}; "
                                     f"stderr: {self.stderr_now()}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"agent's output ended; seen: {self.lines}; stderr: {self.stderr_now()}")
            self.pending += chunk
            *complete, self.pending = self.pending.split(b"\n")
            self.lines += [c.decode() for c in complete]

    def facts(self) -> dict:
        return json.loads(self.line(lambda s: s.startswith("facts ")).removeprefix("facts "))

    def status(self) -> int:
        return int(self.line(lambda s: s.startswith("status ")).split()[1])

    def release(self, timeout: float = 60) -> int:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout)

    def stderr_now(self) -> str:
        if self.proc.poll() is None:
            return "<running>"
        return self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def state(pid: int) -> str:
    return psutil.Process(pid).status()


def warm_files(runtime_dir: str) -> list[str]:
    directory = os.path.join(runtime_dir, f"elastic_ft-warm-{os.getuid()}")
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_two_starts_on_one_agent_are_forks_of_one_warm_process_that_imported_before_them(runtime_dir):
    agent = Agent([PROBE + ["exit", "0"], PROBE + ["exit", "5"]], runtime_dir, hold=False)
    try:
        first, second = agent.facts(), agent.facts()
        assert [agent.status(), agent.status()] == [0, 5]
        assert agent.proc.wait(60) == 5
    finally:
        agent.stop()
    for facts in (first, second):
        assert facts["warm"] and facts["preloaded"], facts  # the preload's module was there before it ran
        assert facts["agent"] == agent.proc.pid and facts["launcher"] != facts["pid"], facts
    assert first["ppid"] == second["ppid"] != agent.proc.pid  # one warm process served both
    # The agent is gone: so is its warm process, and so are its socket and lock.
    wait_until(lambda: gone(first["ppid"]), timeout=30, what="the warm process to end with its agent")
    wait_until(lambda: not warm_files(runtime_dir), timeout=30, what="its files to go")


def test_the_worker_gets_the_launchers_environment_directory_arguments_and_streams(runtime_dir, tmp_path):
    agent = Agent([PROBE + ["exit", "0"]], runtime_dir, hold=False, cwd=str(tmp_path), PROBE_ENV="from-launcher")
    try:
        facts = agent.facts()  # printed by the fork on the launcher's stdout
        assert agent.proc.wait(60) == 0
    finally:
        agent.stop()
    assert facts["warm"]
    assert (facts["cwd"], facts["probe_env"], facts["argv"]) == (str(tmp_path), "from-launcher", ["exit", "0"])


def test_sigterm_to_the_launcher_reaches_the_worker_and_its_status_comes_back(runtime_dir):
    agent = Agent([PROBE + ["wait"]], runtime_dir)
    try:
        facts = agent.facts()
        agent.line(lambda s: s == "ready")
        os.kill(facts["launcher"], signal.SIGTERM)  # what torchrun does to stop a worker (to its group)
        agent.line(lambda s: s == "got SIGTERM")
        assert agent.status() == 43
        assert agent.release() == 43
    finally:
        agent.stop()


def spinning(runtime_dir: str) -> tuple[Agent, dict]:
    """An agent whose one worker runs (and prints ``ready``) until stopped; the worker's facts."""
    agent = Agent([PROBE + ["spin"]], runtime_dir)
    try:
        facts = agent.facts()
        agent.line(lambda s: s == "ready")
    except BaseException:
        agent.stop()
        raise
    return agent, facts


def test_a_launcher_sigkilled_takes_its_worker_along(runtime_dir):
    agent, facts = spinning(runtime_dir)
    try:
        assert facts["warm"]
        os.kill(facts["launcher"], signal.SIGKILL)  # torchrun's last resort, or a lost node
        assert agent.status() == -signal.SIGKILL
        wait_until(lambda: gone(facts["pid"]), timeout=30, what="the worker to end with its launcher")
    finally:
        agent.stop()


def test_a_worker_ended_by_a_signal_ends_its_launcher_by_that_signal(runtime_dir):
    agent = Agent([PROBE + ["killself"]], runtime_dir, hold=False)
    try:
        assert agent.facts()["warm"]
        assert agent.status() == -signal.SIGKILL
    finally:
        agent.stop()


def test_a_stopped_launcher_stops_its_worker_and_sigcont_resumes_it(runtime_dir):
    agent, facts = spinning(runtime_dir)
    try:
        os.kill(facts["launcher"], signal.SIGSTOP)  # a silent node
        wait_until(lambda: state(facts["pid"]) == psutil.STATUS_STOPPED, timeout=30, what="the worker to stop")
        os.kill(facts["launcher"], signal.SIGCONT)
        wait_until(lambda: state(facts["pid"]) != psutil.STATUS_STOPPED, timeout=30, what="the worker to go on")
        os.kill(facts["launcher"], signal.SIGTERM)
        assert agent.status() == 43
    finally:
        agent.stop()


def test_the_agent_gone_ends_the_warm_process_and_every_worker_it_forked(runtime_dir):
    agent, facts = spinning(runtime_dir)
    try:
        os.kill(facts["launcher"], signal.SIGSTOP)  # a stopped worker too: SIGKILL needs no SIGCONT
        wait_until(lambda: state(facts["pid"]) == psutil.STATUS_STOPPED, timeout=30, what="the worker to stop")
        agent.proc.kill()
        agent.proc.wait(30)
        for pid, what in ((facts["pid"], "worker"), (facts["ppid"], "warm process")):
            wait_until(lambda pid=pid: gone(pid), timeout=30, what=f"the {what} to end with the agent")
        wait_until(lambda: not warm_files(runtime_dir), timeout=30, what="the warm process's files to go")
    finally:
        try:
            os.kill(facts["launcher"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        agent.stop()


def one_start(agent: Agent) -> tuple[dict, str]:
    """The facts of the agent's one worker, once the agent ended with 0, and the agent's stderr."""
    try:
        facts = agent.facts()
        assert agent.proc.wait(60) == 0
        return facts, agent.proc.stderr.read()
    finally:
        agent.stop()


def test_a_directory_others_can_enter_is_not_used_and_the_worker_starts_cold_saying_so(runtime_dir):
    os.mkdir(os.path.join(runtime_dir, f"elastic_ft-warm-{os.getuid()}"), 0o755)
    os.chmod(os.path.join(runtime_dir, f"elastic_ft-warm-{os.getuid()}"), 0o755)
    facts, err = one_start(Agent([PROBE + ["exit", "0"]], runtime_dir, hold=False))
    assert not facts["warm"] and not facts["preloaded"]
    assert "starting this worker cold: no private directory for the warm process" in err, err


def test_switched_off_every_worker_starts_cold_without_a_word(runtime_dir):
    agent = Agent([PROBE + ["exit", "0"]], runtime_dir, hold=False, ELASTIC_FT_WARM_START="0")
    facts, err = one_start(agent)
    assert not facts["warm"] and not facts["preloaded"] and facts["ppid"] == agent.proc.pid
    assert "cold" not in err and not warm_files(runtime_dir)


def test_a_warm_process_that_fails_to_start_is_tried_once_per_agent(runtime_dir):
    agent = Agent([PROBE + ["exit", "0"], PROBE + ["exit", "0"]], runtime_dir, hold=False, PROBE_PRELOAD_FAIL="1")
    try:
        facts = [agent.facts(), agent.facts()]
        assert agent.proc.wait(60) == 0
        err = agent.proc.stderr.read()
    finally:
        agent.stop()
    assert not any(f["warm"] for f in facts)
    assert err.count("exited with status 1 while starting") == 1, err
    assert err.count("failed to start before") == 1, err
