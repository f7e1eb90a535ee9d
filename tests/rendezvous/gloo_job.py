"""A tiny elastic gloo job that torchrun starts in the rendezvous tests.

Each worker records who it is (rank, world size, its agent's pid) in
``<out>/workers.jsonl``, then runs steps of one ``all_reduce`` each until
``--steps`` are done. Rank 0 records each finished step in ``<out>/steps.jsonl``
and the step count in ``<out>/progress`` (write-temp + rename), so workers
restarted at another world size resume where the old world stopped: enough
to see a job continue through node loss and growth without the trainer.

``--fail-once-at N`` makes rank 0 exit with an error before step ``N`` the
first time it gets there (a marker file remembers it), as a job whose workers
fail for good (with ``--max-restarts 0``); run again, the job resumes.

``--stop-file PATH`` ends the job early, after the step in which rank 0 first
sees the file (every rank learns it in that step's ``all_reduce``): a test
whose job must outlast a fault it cannot time ends it once its checks passed.

``--report-env NAME`` (repeatable) adds to the worker's record which of the
named variables its environment holds (names only, never values): a test
checks that the agent keeps its secrets from its workers.

``--step-time`` paces steps so a test can act while the job runs; the pause
is the job's simulated compute, not a test waiting for a condition.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def append_line(path: Path, record: dict) -> None:
    # One small O_APPEND write per line: lines from several processes do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_progress(path: Path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--fail-once-at", type=int, default=0)
    parser.add_argument("--pg-timeout", type=float, default=60.0,
                        help="seconds the process group's start and each collective wait for a peer")
    parser.add_argument("--stop-file", default=None,
                        help="end after the step in which rank 0 sees this file (instead of at --steps)")
    parser.add_argument("--report-env", action="append", default=[],
                        help="a variable name; the record lists those present in the environment")
    args = parser.parse_args()
    out = Path(args.out)

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    append_line(
        out / "workers.jsonl",
        {
            "rank": rank,
            "world_size": world,
            "env_world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
            "group_rank": int(os.environ["GROUP_RANK"]),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "agent_pid": os.getppid(),
            "pid": os.getpid(),
            "env_present": sorted(name for name in args.report_env if name in os.environ),
        },
    )

    # Every rank starts from rank 0's view of the progress file.
    start = torch.tensor([read_progress(out / "progress") if rank == 0 else 0])
    dist.broadcast(start, src=0)
    step = int(start.item())
    while step < args.steps:
        failed_once = out / "failed-once"
        if rank == 0 and step + 1 == args.fail_once_at and not failed_once.exists():
            failed_once.touch()
            raise SystemExit(f"failing before step {step + 1} (--fail-once-at)")
        time.sleep(args.step_time)
        stop = rank == 0 and args.stop_file is not None and os.path.exists(args.stop_file)
        value = torch.tensor([1.0, float(stop)])
        dist.all_reduce(value)
        if int(value[0].item()) != world:
            raise RuntimeError(f"all_reduce gave {value[0].item()} with world size {world}")
        step += 1
        if rank == 0:
            # The step's line goes first: a rank 0 killed between the two writes
            # then leaves a step recorded twice (harmless), never a step that the
            # progress counter skips but no line records.
            append_line(out / "steps.jsonl", {"step": step, "world_size": world})
            tmp = out / "progress.tmp"
            tmp.write_text(str(step))
            os.replace(tmp, out / "progress")
        if value[1].item() > 0:
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
