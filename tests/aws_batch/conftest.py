"""Shared pieces of the AWS Batch scheduler tests: the component's arguments, dry runs, the torchx CLI."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Mapping, Sequence

from torchx.runner import get_runner
from torchx.schedulers.api import AppDryRunInfo

from tests.conftest import BIN, run

ETCD = "10.0.0.5:2379"
CHECKPOINTS = "s3://elastic-ft-test/runs"
RUN_ID = "exp1"


def train_args(*, overrides: Sequence[str] = ("steps=5",), **options: str | None) -> list[str]:
    """``elastic_ft.train``'s arguments for a job that can run on aws_batch; ``options`` replace
    (``None``: drop) the good ones, e.g. ``train_args(nnodes="1", run_id=None)``."""
    good = {
        "nnodes": "2:8", "nproc_per_node": "2", "run_id": RUN_ID, "checkpoint_uri": CHECKPOINTS,
        "rdzv_backend": "etcd3", "rdzv_endpoint": ETCD,
    }
    args = []
    for name, value in {**good, **options}.items():
        if value is not None:
            args += [f"--{name}", value]
    return [*args, "--", *overrides]


def dryrun(args: Sequence[str], component: str = "elastic_ft.train", **cfg: Any) -> AppDryRunInfo:
    """torchx's own dry run of ``component`` on ``aws_batch`` (queue ``q`` unless given)."""
    with get_runner() as runner:
        return runner.dryrun_component(component, list(args), "aws_batch", cfg={"queue": "q", **cfg})


def torchx(*args: str, env: Mapping[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The ``torchx`` command of this venv (``run`` gets ``--workspace ""``: no image is built)."""
    argv = [os.path.join(BIN, "torchx"), *args]
    if args and args[0] == "run":
        argv[2:2] = ["--workspace", ""]
    return run(argv, env=dict(env) if env else None, timeout=timeout)


def scheduler_request(stdout: str) -> dict:
    """The JSON the dry run prints after torchx's ``=== SCHEDULER REQUEST ===`` header."""
    head = "=== SCHEDULER REQUEST ==="
    assert head in stdout, stdout[-2000:]
    return json.loads(stdout.split(head, 1)[1])
