"""A ready GPU check (not part of CI): the real stack on CUDA over NCCL in bf16, figures printed.

Run by ``scripts/gpu_smoke.sh`` on a host with NVIDIA GPUs (it refuses, with one line and exit status 2,
where there is none). The checks, each one or more ``torchrun`` jobs of ``elastic_ft.worker`` on
127.0.0.1 with file:// checkpoints in a temporary directory:

- ``lora-1``/``lora-2``: specs/tiny-lora.yaml (DDP, LoRA) on 1 and 2 GPUs, bf16 base weights and compute;
- ``fsdp-1``/``fsdp-2``: specs/tiny-full-fsdp.yaml (FSDP2 full fine-tune) on 1 and 2 GPUs, bf16 compute;
- ``notice``: a terminate notice served by a local IMDS (tests/spot/imds_server.py) mid-run: the job
  commits the step it is at and its workers exit 75; the same command resumes after it and finishes;
- ``kill``: the last rank SIGKILLs itself at step 7 (``ELASTIC_FT_FAULTS``); torchrun restarts the
  workers, which resume from the newest commit and finish;
- ``bench``: bench/step_overhead.py (the trainer's step against a plain DDP + peft loop) on the GPUs.

Every job must exit as expected, train every sample of its steps exactly once (the ledger), and end
with a finite loss below its first one. The 2-GPU checks are skipped (said so) on a host with one GPU;
``notice``, ``kill`` and ``bench`` use 2 GPUs where there are 2. Exit status: 0 all passed, 1 a check
failed (its log's tail is printed), 2 refused (no GPU, no bf16, bad arguments).

    scripts/gpu_smoke.sh [--dry-run] [--gpus N] [--only NAME,...] [--keep DIR]

``--dry-run`` prints the plan (each check's command) without running anything, for ``--gpus`` GPUs
(default: those present, or 2 where there are none). ``--cpu`` rehearses the same checks on the CPU (gloo,
float32, processes for GPUs, a shorter bench): it checks this script, not the GPU path.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BF16 = ["precision.param_dtype=bfloat16", "precision.compute=bfloat16"]
COMMON = ["checkpoint.keep_last=null", "logging.ledger=true", "logging.every_steps=5", "optimizer.warmup_steps=2"]
SPECS = {"lora": os.path.join(ROOT, "specs", "tiny-lora.yaml"), "fsdp": os.path.join(ROOT, "specs", "tiny-full-fsdp.yaml")}
JOB_TIMEOUT_S = 600.0
NOTICE_STEPS = 2000  # long enough that the notice, seen within 0.1 s, lands mid-run even at ~5 ms a step
REFUSED, FAILED = 2, 1


class CheckFailed(Exception):
    """A check's expectation did not hold (the message says which, with the job's log tail)."""


@dataclasses.dataclass
class Job:
    """One torchrun job of the worker: its command and environment, and its run's directory."""

    name: str
    spec: str
    nproc: int
    overrides: list[str]
    root: str
    max_restarts: int = 0
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.root, self.name)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.nproc),
                "--max-restarts", str(self.max_restarts), "-m", "elastic_ft.worker", "--spec", self.spec,
                "--run_id", self.name, "--checkpoint_uri", f"file://{self.root}",
                "--log_dir", os.path.join(self.run_dir, "logs"), *self.overrides]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        env.pop("ELASTIC_FT_FAULTS", None)
        env.update(self.env)
        return env

    def shown(self) -> str:
        """The command as a shell would run it (the environment it adds first)."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())),
                         *(shlex.quote(a) for a in self.command())])

    def start(self) -> subprocess.Popen:
        """Start the job, its output appended to ``<root>/<name>.log`` (a pipe nobody reads would fill up)."""
        os.makedirs(self.root, exist_ok=True)
        with open(self.log_path, "a") as log:
            proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.environment(), stdout=log,
                                    stderr=subprocess.STDOUT)
        proc.log_path = self.log_path  # type: ignore[attr-defined]
        return proc

    @property
    def log_path(self) -> str:
        return os.path.join(self.root, f"{self.name}.log")

    def run(self) -> subprocess.CompletedProcess:
        return finish(self.start())

    def events(self) -> list[dict]:
        from elastic_ft.runevents.events import read_events

        path = os.path.join(self.run_dir, "logs", "events.jsonl")
        return read_events(path) if os.path.exists(path) else []


def finish(proc: subprocess.Popen, timeout_s: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Wait for a started job (killed after ``timeout_s``); its exit status and the log so far."""
    note = ""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        note = f"\n[gpu_smoke: killed after {timeout_s:g} s]"
    with open(proc.log_path, errors="replace") as f:  # type: ignore[attr-defined]
        return subprocess.CompletedProcess(proc.args, proc.returncode, f.read() + note, None)


def tail(proc: subprocess.CompletedProcess, lines: int = 40) -> str:
    return "\n".join((proc.stdout or "").splitlines()[-lines:])


def expect(ok: bool, what: str, proc: subprocess.CompletedProcess | None = None) -> None:
    if not ok:
        raise CheckFailed(what + ("" if proc is None else "\n" + tail(proc)))


def figures(job: Job, proc: subprocess.CompletedProcess, steps: int) -> str:
    """What the job's events say: the ledger checked, then its step time, losses and checkpoint costs."""
    from elastic_ft.runevents.ledger import check_exactly_once, replay

    events = job.events()
    history = replay(events)
    expect(sorted(history) == list(range(steps)), f"{job.name}: the final history has steps {sorted(history)[:5]}..., "
                                                   f"not 0..{steps - 1}", proc)
    size = next(e["dataset_size"] for e in events if e["event"] == "start")
    problems = check_exactly_once(history, size)
    expect(not problems, f"{job.name}: samples not trained exactly once: {problems[:3]}", proc)
    losses = [e["loss"] for e in events if e["event"] == "step" and e.get("loss") is not None]
    expect(bool(losses) and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0],
           f"{job.name}: losses {losses[:2]}...{losses[-2:]} are not finite and falling", proc)
    step_s = [e["seconds"] for e in events if e["event"] == "step_done"]
    blocked = [e["blocked_s"] for e in events if e["event"] == "checkpoint_committed" and e.get("blocked_s") is not None]
    worlds = sorted({e["world"] for e in events if e["event"] == "start"})
    saves = f"checkpoint blocked median {statistics.median(blocked) * 1e3:.2f} ms" if blocked else "no async save"
    return (f"world {worlds}, {len(step_s)} steps run, median {statistics.median(step_s) * 1e3:.1f} ms/step, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {saves}")


# --------------------------------------------------------------------------- the checks


@dataclasses.dataclass(frozen=True)
class Mode:
    """How the checks run: on the GPUs in bf16, or rehearsed on the CPU (``--cpu``)."""

    precision: tuple[str, ...] = tuple(BF16)
    env: tuple[tuple[str, str], ...] = ()
    bench_steps: int = 100
    notice_steps: int = NOTICE_STEPS


GPU = Mode()
# CPU steps take 20 ms to seconds on a loaded host: a notice after step 10 still lands well before step 60.
CPU_REHEARSAL = Mode(precision=(), env=(("CUDA_VISIBLE_DEVICES", ""),), bench_steps=20, notice_steps=60)


def train_check(strategy: str, nproc: int, mode: Mode) -> Callable[[str], tuple[str, list[Job]]]:
    steps = 20

    def jobs(root: str) -> list[Job]:
        return [Job(f"{strategy}-{nproc}", SPECS[strategy], nproc,
                    [f"steps={steps}", "checkpoint.every_steps=10", *COMMON, *mode.precision], root,
                    env=dict(mode.env))]

    def run(root: str) -> tuple[str, list[Job]]:
        (job,) = jobs(root)
        proc = job.run()
        expect(proc.returncode == 0, f"{job.name}: exit {proc.returncode}", proc)
        return figures(job, proc, steps), [job]

    run.jobs = jobs  # type: ignore[attr-defined]
    return run


def notice_check(nproc: int, mode: Mode) -> Callable[[str], tuple[str, list[Job]]]:
    from elastic_ft.spot.imds import ENDPOINT_ENV

    def jobs(root: str, url: str = "http://127.0.0.1:<local IMDS>") -> list[Job]:
        job = Job(f"notice-{nproc}", SPECS["lora"], nproc,
                  [f"steps={mode.notice_steps}", "checkpoint.every_steps=100", "spot.poll_interval_s=0.1", *COMMON,
                   *mode.precision], root, env={**dict(mode.env), ENDPOINT_ENV: url})
        return [job, job]  # the same command twice: preempted, then resumed

    def run(root: str) -> tuple[str, list[Job]]:
        from elastic_ft.train.preemption import PREEMPTED_EXIT_CODE
        from tests.spot.imds_server import FakeImds

        imds = FakeImds().start()
        try:
            job = jobs(root, imds.url)[0]
            proc = job.start()
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while not any(e["event"] == "step" and e["step"] >= 10 for e in job.events()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise CheckFailed(f"{job.name}: no step 10 before the notice\n{tail(finish(proc, 5))}")
                time.sleep(0.05)
            when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
            t_notice = time.monotonic()
            imds.set_instance_action({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")})
            first = finish(proc)
            left_s = time.monotonic() - t_notice
            # Its workers exit 75; a standalone torchrun (no etcd3 rendezvous to leave) reports that as a failure.
            left = [e for e in job.events() if e["event"] == "preempted"]
            expect(first.returncode != 0 and len(left) == 1 and left[0]["exit_code"] == PREEMPTED_EXIT_CODE,
                   f"{job.name}: exit {first.returncode} after the notice, preempted events {left} (one, with "
                   f"exit code {PREEMPTED_EXIT_CODE}, expected)", first)
            left = left[0]
            committed = [e["step"] for e in job.events() if e["event"] == "checkpoint_committed"]
            expect(max(committed) == left["step"], f"{job.name}: left at step {left['step']}, newest commit "
                                                   f"{max(committed)}", first)
            imds.set_instance_action(None)
            second = job.run()
        finally:
            imds.stop()
        expect(second.returncode == 0, f"{job.name}: the rerun exited {second.returncode}", second)
        resumes = [e["step"] for e in job.events() if e["event"] == "resume_plan"]
        expect(resumes == [0, left["step"]], f"{job.name}: resumed at {resumes}, not [0, {left['step']}]", second)
        return (f"left at step {left['step']} {left_s:.1f} s after the notice (commit included), resumed there; "
                + figures(job, second, mode.notice_steps)), [job]

    run.jobs = jobs  # type: ignore[attr-defined]
    return run


def kill_check(nproc: int, mode: Mode) -> Callable[[str], tuple[str, list[Job]]]:
    steps, kill_at = 20, 7

    def jobs(root: str) -> list[Job]:
        return [Job(f"kill-{nproc}", SPECS["lora"], nproc,
                    [f"steps={steps}", "checkpoint.every_steps=5", "checkpoint.async_save=false", *COMMON,
                     *mode.precision], root, max_restarts=1,
                    env={**dict(mode.env), "ELASTIC_FT_FAULTS": f"kill:rank={nproc - 1},step={kill_at},restart=0"})]

    def run(root: str) -> tuple[str, list[Job]]:
        (job,) = jobs(root)
        proc = job.run()
        expect(proc.returncode == 0, f"{job.name}: exit {proc.returncode} (torchrun should have restarted the "
                                     f"workers once)", proc)
        resumes = [e["step"] for e in job.events() if e["event"] == "resume_plan"]
        expect(resumes == [0, 5], f"{job.name}: resumed at {resumes}, not [0, 5] (rank {nproc - 1} SIGKILLed at "
                                  f"step {kill_at}, step 5 committed)", proc)
        return f"rank {nproc - 1} killed at step {kill_at}, resumed at 5; " + figures(job, proc, steps), [job]

    run.jobs = jobs  # type: ignore[attr-defined]
    return run


def bench_check(world: int, mode: Mode) -> Callable[[str], tuple[str, list[Job]]]:
    command = [sys.executable, os.path.join(ROOT, "bench", "step_overhead.py"), "--world", str(world),
               "--steps", str(mode.bench_steps), "--block", "5", "--warmup", "5", *mode.precision]

    def run(root: str) -> tuple[str, list[Job]]:
        proc = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, **dict(mode.env)),
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        proc.stdout += proc.stderr
        expect(proc.returncode == 0, f"bench: exit {proc.returncode}", proc)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("trainer :", "baseline:", "ratio"))]
        return "; ".join(lines), []

    run.command = command  # type: ignore[attr-defined]
    return run


@dataclasses.dataclass
class Check:
    name: str
    gpus: int
    """GPUs it needs."""
    run: Callable[[str], tuple[str, list[Job]]]


def plan(gpus: int, mode: Mode = GPU) -> list[Check]:
    """Every check, in the order run; those needing more than ``gpus`` GPUs are reported as skipped."""
    most = min(2, gpus) if gpus else 2
    return [
        Check("lora-1", 1, train_check("lora", 1, mode)),
        Check("lora-2", 2, train_check("lora", 2, mode)),
        Check("fsdp-1", 1, train_check("fsdp", 1, mode)),
        Check("fsdp-2", 2, train_check("fsdp", 2, mode)),
        Check("notice", most, notice_check(most, mode)),
        Check("kill", most, kill_check(most, mode)),
        Check("bench", most, bench_check(most, mode)),
    ]


def describe(check: Check, root: str) -> list[str]:
    """The commands a check runs, as a shell would (for --dry-run)."""
    jobs = getattr(check.run, "jobs", None)
    if jobs is not None:
        return [j.shown() for j in jobs(root)]
    return [" ".join(shlex.quote(a) for a in check.run.command)]  # type: ignore[attr-defined]


def gpu_problem() -> tuple[int, str | None]:
    """(GPUs torch sees, why the checks cannot run here or None)."""
    import torch

    if not torch.cuda.is_available():
        return 0, (f"no CUDA GPU is visible to torch {torch.__version__} ({sys.executable}); run it on a host "
                   f"with NVIDIA GPUs and a CUDA build of torch (or --dry-run to see the plan)")
    if not torch.cuda.is_bf16_supported():
        return torch.cuda.device_count(), f"{torch.cuda.get_device_name(0)} has no bfloat16: the checks run in bf16"
    return torch.cuda.device_count(), None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_smoke.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the checks and their commands, run nothing")
    p.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (default: those present)")
    p.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this directory")
    p.add_argument("--cpu", action="store_true",
                   help="rehearse the checks on the CPU (gloo, float32; --gpus processes): checks the script only")
    args = p.parse_args(argv)
    if args.gpus is not None and not 1 <= args.gpus <= 64:
        p.error(f"--gpus must be between 1 and 64, got {args.gpus}")
    if args.cpu or (args.dry_run and args.gpus):
        present, problem = args.gpus or 2, None
    else:
        present, problem = gpu_problem()
    if problem and not args.dry_run:
        print(f"scripts/gpu_smoke.sh: {problem}", file=sys.stderr)
        return REFUSED
    gpus = args.gpus if args.gpus is not None else (present or 2)
    checks = plan(gpus, CPU_REHEARSAL if args.cpu else GPU)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in checks}
        if unknown:
            p.error(f"--only: no check named {', '.join(sorted(unknown))} (checks: "
                    f"{', '.join(c.name for c in checks)})")
        checks = [c for c in checks if c.name in wanted]
    if args.dry_run:
        for c in checks:
            state = "skip" if c.gpus > gpus else "run "
            print(f"{state} {c.name} ({c.gpus} GPU{'s' * (c.gpus > 1)})")
            for line in describe(c, args.keep or "<tmp>"):
                print(f"     {line}")
        return 0
    if args.gpus is not None and args.gpus > present:
        print(f"scripts/gpu_smoke.sh: --gpus {args.gpus}, but torch sees {present} GPU(s)", file=sys.stderr)
        return REFUSED
    import torch

    if args.cpu:
        print(f"gpu_smoke: rehearsal on the CPU ({gpus} process(es) for GPUs), torch {torch.__version__}", flush=True)
    else:
        print(f"gpu_smoke: {present} x {torch.cuda.get_device_name(0)}, torch {torch.__version__} "
              f"(CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})", flush=True)
    results: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="elastic-ft-gpu-smoke-") as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        for c in checks:
            if c.gpus > gpus:
                results.append(("SKIP", c.name, f"needs {c.gpus} GPUs, {gpus} here"))
            else:
                t0 = time.monotonic()
                try:
                    said, _ = c.run(root)
                    results.append(("PASS", c.name, f"{said} ({time.monotonic() - t0:.0f} s)"))
                except CheckFailed as exc:
                    results.append(("FAIL", c.name, str(exc)))
                except Exception as exc:  # a check's own error is that check's failure; the others still run
                    results.append(("FAIL", c.name, f"{type(exc).__name__}: {exc}"))
            state, name, said = results[-1]
            print(f"{state} {name}: {said}", flush=True)
    failed = [n for s, n, _ in results if s == "FAIL"]
    print(f"gpu_smoke: {sum(s == 'PASS' for s, _, _ in results)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "")
          + f", {sum(s == 'SKIP' for s, _, _ in results)} skipped")
    return FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
