"""A local rehearsal of the AWS Batch array job: the command the dry run plans, run on this machine.

torchx's ``aws_batch`` dry run plans what would be submitted (an
:class:`elastic_ft.aws_batch.request.ArrayJobRequest`). Its container command
(``bash -c LINE``) runs here from the repository root, the image's workdir,
once per array child, with the environment Batch gives a child: the job
definition's variables plus ``AWS_BATCH_JOB_ARRAY_INDEX``,
``AWS_BATCH_JOB_ATTEMPT`` and ``AWS_BATCH_JOB_ID``. What AWS provides is local:
etcd for the rendezvous, SeaweedFS for the S3 checkpoints, an IMDS with no spot
notice. Once the job trains at full size, the host of the child whose worker
holds rank 0 is lost (the child's whole process tree SIGKILLed); the others go
on without it, and Batch's retry, attempt 2 of the same child with the same
command, joins the running job again. Every child then exits 0, the newest
checkpoint on S3 is the final step's, and the ledger shows every sample
consumed exactly once, in the cursor's order. ``elastic-ft events`` on the S3 location shows every
step's event once, the lost leader's included, ``status`` reports the node loss, and ``plot`` draws it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from elastic_ft.config import load_spec
from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from elastic_ft.runevents.merge import latest_steps
from elastic_ft.spot.imds import ENDPOINT_ENV
from elastic_ft.train.cursor import take
from tests.checkpoint.s3_servers import aws_env
from tests.conftest import DEFAULT_SPEC, cli, explain, png_size, process_env
from tests.rendezvous.agents import Agent, child_env, stop_leftovers, wait_for
from tests.spot.imds_server import FakeImds

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torchrun,
    pytest.mark.etcd,
    pytest.mark.s3server,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (scripts/setup.sh --test)"),
]

NODES = 3
# The loss comes at step 4 or so; the survivors resume there and the retry joins about 4 steps later
# (on 2 cores, loaded or not: its agent is waiting in the rendezvous seconds after it starts, before its
# worker's imports, and the survivors then commit and let it in; the agent's start and the survivors' steps
# slow down together under load), so 28 steps leave it about four times the room it needs to join before
# the end, even where the world first grew to 3 a round late and the loss comes at step 8. Each step after
# that, at world 3, only adds time (40 steps cost the suite ~10 s more).
STEPS = 28
WAIT_S = 240.0  # generous bounds for each phase: CI's 2 cores are loaded
DATASET_SIZE = 1024  # data/tiny-corpus.jsonl


@dataclasses.dataclass(frozen=True)
class PlannedJob:
    """What the dry run would submit, as far as a child sees it."""

    job_name: str
    line: str  # the container command is ["bash", "-c", line]
    environment: dict[str, str]  # the job definition's variables
    array_size: int
    retry_strategy: dict


def plan_job(args: list[str]) -> PlannedJob:
    """The dry run of ``elastic_ft.train`` on ``aws_batch``: nothing is submitted, no AWS is reached."""
    from torchx.runner import get_runner

    request = get_runner().dryrun_component("elastic_ft.train", args, "aws_batch", cfg={"queue": "rehearsal"}).request
    container = request.job_definition["containerProperties"]
    command = container["command"]
    assert command[:2] == ["bash", "-c"] and len(command) == 3, command
    return PlannedJob(
        job_name=request.submit_job["jobName"],
        line=command[2],
        environment={v["name"]: v["value"] for v in container.get("environment", [])},
        array_size=request.submit_job["arrayProperties"]["size"],
        retry_strategy=request.submit_job["retryStrategy"],
    )


def batch_action(plan: PlannedJob, attempt: int, *, exit_code: int | None, status_reason: str | None) -> str:
    """What Batch does with a child's finished attempt under the plan's retry strategy: RETRY or EXIT."""
    from elastic_ft.aws_batch.retry import decide

    strategy = plan.retry_strategy
    return str(decide(strategy["evaluateOnExit"], exit_code=exit_code, status_reason=status_reason, reason=None,
                      attempt=attempt, attempts=strategy["attempts"]))


@pytest.fixture
def imds():
    """The instance metadata service of every child's host: no spot notice (404s)."""
    server = FakeImds().start()
    yield server
    server.stop()


def worker_worlds(child: Agent) -> dict[int, int]:
    """rank -> world size of each worker in ``child``'s process tree, from the variables torchrun gave it."""
    worlds = {}
    for pid in child.descendants():
        try:
            env = psutil.Process(pid).environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # it just ended
            continue
        if "RANK" in env and "WORLD_SIZE" in env:
            worlds[int(env["RANK"])] = int(env["WORLD_SIZE"])
    return worlds


class ArrayJob:
    """The children of one planned array job on this machine; a child is a ``bash -c LINE`` process tree."""

    def __init__(self, plan: PlannedJob, tmp: Path, s3, imds: FakeImds) -> None:
        self.plan, self.tmp, self.s3, self.imds = plan, tmp, s3, imds
        self.events_path = tmp / "logs" / "events.jsonl"
        self.children: list[Agent] = []  # the newest attempt of each index

    def environment(self, index: int, attempt: int) -> dict[str, str]:
        """This machine's environment (the venv first on PATH, as in the image), the job definition's
        variables over it, Batch's own for the child, and the local stand-ins for S3 and IMDS."""
        env = child_env()
        env.update(self.plan.environment)
        env.update(
            AWS_BATCH_JOB_ARRAY_INDEX=str(index), AWS_BATCH_JOB_ATTEMPT=str(attempt),
            AWS_BATCH_JOB_ID=f"{self.plan.job_name}:{index}",
        )
        env[ENDPOINT_ENV] = self.imds.url
        return aws_env(env, self.s3, str(self.tmp))

    def start(self, index: int, attempt: int) -> Agent:
        child = Agent(["bash", "-c", self.plan.line], self.tmp / f"child{index}.attempt{attempt}.log",
                      env=self.environment(index, attempt))
        if index < len(self.children):
            self.children[index] = child
        else:
            self.children.append(child)
        return child

    def events(self) -> list[dict]:
        return read_events(str(self.events_path)) if self.events_path.exists() else []

    def training_at(self, world: int, after: int = 0) -> tuple[int, dict] | None:
        """(index, event) of the newest start at ``world`` from event index ``after`` on, once it trained a step."""
        log = self.events()
        starts = [i for i, e in enumerate(log) if i >= after and e["event"] == "start" and e["world"] == world]
        if starts and any(e["event"] == "step" for e in log[starts[-1]:]):
            return starts[-1], log[starts[-1]]
        return None

    def committed_at(self, world: int) -> dict | None:
        """The first start at ``world``, once a checkpoint was committed after it."""
        log = self.events()
        first = next((i for i, e in enumerate(log) if e["event"] == "start" and e["world"] == world), None)
        if first is not None and any(e["event"] == "checkpoint_committed" for e in log[first:]):
            return log[first]
        return None

    def holder_of(self, pid: int) -> int:
        """The index of the child whose process tree runs ``pid``."""
        return next(i for i, child in enumerate(self.children) if pid in child.descendants())


def test_planned_batch_job_runs_here_loses_a_child_and_its_retry_rejoins(etcd, seaweed, imds, tmp_path):
    run_id = f"rehearsal-{tmp_path.name[-40:]}".strip("-_.")
    checkpoint_uri = f"s3://{seaweed.bucket}/runs"
    plan = plan_job([
        "--nnodes", f"2:{NODES}", "--nproc_per_node", "1", "--run_id", run_id,
        "--checkpoint_uri", checkpoint_uri, "--log_dir", str(tmp_path / "logs"),
        "--rdzv_backend", "etcd3", "--rdzv_endpoint", etcd.endpoint,
        # One-second heartbeats: the lost child is dropped after 3 s; rounds close 2 s after the last join.
        "--rdzv_conf", "join_timeout=300,last_call_timeout=2,keep_alive_interval=1",
        "--spec", DEFAULT_SPEC,
        f"steps={STEPS}", "checkpoint.every_steps=4", "checkpoint.keep_last=null", "logging.ledger=true",
        "logging.every_steps=1",
    ])
    assert plan.array_size == NODES

    job = ArrayJob(plan, tmp_path, seaweed, imds)
    uri = f"{checkpoint_uri}/{run_id}"
    try:
        for index in range(NODES):
            job.start(index, attempt=1)
        # The children may meet in one round, or the world may grow to 3 as late ones join.
        start = wait_for(lambda: job.committed_at(NODES), WAIT_S, "a checkpoint committed at world size 3",
                         job.children)
        victim = job.holder_of(start["pid"])  # the leader's host is lost: the harder case
        survivors = [c for i, c in enumerate(job.children) if i != victim]
        job.children[victim].kill_tree()
        killed_at = len(job.events())
        # A reclaimed host ends its container with no exit code and this status reason.
        assert batch_action(plan, 1, exit_code=None,
                            status_reason="Host EC2 (instance i-0123456789abcdef0) terminated.") == "RETRY"
        # The survivors go on at world 2 before Batch's retry of the child starts on a new host.
        wait_for(lambda: job.training_at(NODES - 1, after=killed_at), WAIT_S, "the survivors training at world 2",
                 survivors)
        retry = job.start(victim, attempt=2)
        back_at = len(job.events())
        # The retry's own worker is one of the three ranks that train (torchrun gave it RANK and WORLD_SIZE).
        wait_for(lambda: job.training_at(NODES, after=back_at) and NODES in worker_worlds(retry).values(), WAIT_S,
                 "a step at world size 3 with the retry's worker in it", [*survivors, retry])
        # Meanwhile, from any machine: the run's status, its world read from the rendezvous in etcd.
        env = aws_env(process_env(), seaweed, str(tmp_path))
        live = cli("status", uri, "--rdzv_endpoint", etcd.endpoint, env=env)
        codes = [child.wait(timeout=2 * WAIT_S) for child in job.children]  # the rest of the training
        assert codes == [0] * NODES, "\n".join(f"--- child {i}\n{c.tail()}" for i, c in enumerate(job.children))
    finally:
        stop_leftovers(job.children)

    # The Batch variables reached the worker through bash and torchrun (the start event names its node).
    assert start.get("node") == f"array index {victim}, attempt 1", start
    # Every child's last attempt ended as Batch ends a job on success: no further retry.
    success = "Essential container in task exited"
    ended = [batch_action(plan, 2 if i == victim else 1, exit_code=0, status_reason=success) for i in range(NODES)]
    assert ended == ["EXIT"] * NODES

    log = job.events()
    # The survivors resumed from the newest checkpoint committed before the loss, read back from S3
    # (a newer one, if the leader's commit landed on S3 just before it died, before its event).
    committed = [e["step"] for e in log[:killed_at] if e["event"] == "checkpoint_committed"]
    resumed = [e["step"] for e in log[killed_at:back_at] if e["event"] == "resume_plan"]
    assert committed and len(resumed) == 1 and resumed[0] >= max(committed), (committed, resumed)
    lost = [e for e in log[killed_at:back_at] if e["event"] == "node_lost"]
    assert len(lost) == 1, lost
    # The retry's join is a later round at world 3, after which the job trains to the end.
    assert [e["world"] for e in log[back_at:] if e["event"] == "start"][-1] == NODES
    assert log[-1]["event"] == "end" and log[-1]["step"] == STEPS, log[-1]
    history = replay(log)
    assert check_exactly_once(history, DATASET_SIZE) == []
    consumed = [p for step in sorted(history) for p in history[step]]
    spec = load_spec(DEFAULT_SPEC)
    assert consumed == take(0, STEPS * spec.batch.global_batch, DATASET_SIZE, spec.seed)
    # The children's spot watchers polled the IMDS they were given.
    assert imds.counts()[0] > 0, "no child asked the local IMDS for a token"

    # On S3, through the project's own CLI. The commands only read the finished run: they run together, as
    # several users could (each is mostly its own interpreter's start).
    png = str(tmp_path / "run.png")
    commands = {"ls": ("ckpt", "ls", uri), "verify": ("ckpt", "verify", uri), "events": ("events", uri),
                "status": ("status", uri), "plot": ("plot", uri, "--out", png, "--width", "900", "--height", "600")}
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        running = {name: pool.submit(cli, *args, env=env) for name, args in commands.items()}
        done = {name: proc.result() for name, proc in running.items()}
    # The newest committed checkpoint is the final step's, and it verifies.
    ls, verify = done["ls"], done["verify"]
    assert ls.returncode == 0, explain(ls)
    assert ls.stdout.splitlines()[-1].split()[0] == str(STEPS), ls.stdout
    assert verify.returncode == 0 and f"checkpoint at step {STEPS} OK" in verify.stdout, explain(verify)
    lost_attempt = [e["attempt"] for e in log[:killed_at] if e["event"] == "start"][-1]
    run_events_on_s3_survive_the_lost_leader(uri, log, lost_attempt, live, done["events"], done["status"])
    plot_of_the_s3_run(uri, png, done["plot"])


def plot_of_the_s3_run(uri: str, out: str, proc: subprocess.CompletedProcess) -> None:
    """``elastic-ft plot`` from the S3 location's events: every step, the lost node and the restarts marked."""
    assert proc.returncode == 0, explain(proc)
    assert png_size(out) == (900, 600)
    assert f": {STEPS} steps, " in proc.stdout and "1 node_lost" in proc.stdout, proc.stdout
    assert f"from {uri}/events/" in proc.stdout, proc.stdout


def run_events_on_s3_survive_the_lost_leader(uri: str, log: list[dict], lost_attempt: int,
                                             live: subprocess.CompletedProcess, out: subprocess.CompletedProcess,
                                             status: subprocess.CompletedProcess) -> None:
    """``elastic-ft events`` and ``status`` on the S3 location: what the leaders shipped there, the lost one's
    included, has every step once (the ledger proves every sample once from it alone) and the node loss."""
    assert live.returncode == 0, explain(live)
    assert f"world: {NODES} rank(s) on {NODES} node(s) (rendezvous round" in live.stdout, live.stdout
    assert out.returncode == 0, explain(out)
    shipped = [json.loads(line) for line in out.stdout.splitlines()]
    for name in ("step", "step_done"):
        assert [e["step"] for e in shipped if e["event"] == name] == list(range(1, STEPS + 1)), name
        # Each the latest attempt's: the one the local file (all leaders wrote it on this machine) says.
        assert [e for e in shipped if e["event"] == name] == [e for e in latest_steps(log) if e["event"] == name]
    history = replay(shipped)
    assert check_exactly_once(history, DATASET_SIZE) == [] and sorted(history) == list(range(STEPS))
    # The lost leader's attempt: its step events up to the step the survivors resumed from are on S3, shipped by
    # it up to its last commit, and the rest carried by the step a survivor kept in memory and written again by
    # the next leader (checkpoint.keep_step_in_memory), which then supersede any the lost one shipped.
    lost = [e for e in shipped if e["attempt"] == lost_attempt]
    began = next(e["step"] for e in lost if e["event"] == "resume_plan")
    resumed = next(e["step"] for e in shipped if e["event"] == "resume_plan" and e["attempt"] == lost_attempt + 1)
    carried = [e["step"] for e in shipped if e["event"] == "step" and e["attempt"] == lost_attempt + 1
               and e.get("carried")]
    assert sorted([e["step"] for e in lost if e["event"] == "step"] + carried) == list(range(began + 1, resumed + 1)), \
        (began, resumed, carried)
    assert len([e for e in shipped if e["event"] == "node_lost"]) == 1
    assert [e["event"] for e in shipped].count("end") == 1 and shipped[-1]["event"] == "end"
    assert status.returncode == 0, explain(status)
    assert f"steps: {STEPS} of {STEPS} (100.0 %); finished" in status.stdout, status.stdout
    assert "nodes lost: 1;" in status.stdout and "  node lost: " in status.stdout, status.stdout
    assert f"last checkpoint: step {STEPS}," in status.stdout, status.stdout
