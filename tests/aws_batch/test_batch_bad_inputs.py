"""Inputs that cannot run on AWS Batch are refused by ``torchx run -s aws_batch --dryrun``: exit 1, one
clear line naming the argument or run option, no traceback, nothing planned."""

from __future__ import annotations

import pytest

from tests.aws_batch.conftest import torchx, train_args
from tests.conftest import explain

pytestmark = pytest.mark.torchrun  # the torchx CLI's dry run

CASES = {
    "nnodes min 0": ({"nnodes": "0:8"}, "queue=q", "--nnodes '0:8': need 1 <= MIN <= MAX"),
    "nnodes min over max": ({"nnodes": "8:2"}, "queue=q", "--nnodes '8:2': need 1 <= MIN <= MAX"),
    # A global batch that 10001 nodes of 2 processes fit, so that only AWS Batch's limit is in the way.
    "nnodes over 10000": ({"nnodes": "2:10001", "overrides": ("steps=5", "batch.global_batch=20002")}, "queue=q",
                          "--nnodes: a max of 10001 nodes is over"),
    "no queue": ({}, "user=alice", "missing required option: `queue`"),
    "file checkpoint": ({"checkpoint_uri": "file:///data/runs"}, "queue=q",
                        "--checkpoint_uri: a file:// URI is local to one node"),
    "c10d rendezvous": ({"rdzv_backend": "c10d", "rdzv_endpoint": None}, "queue=q",
                        "--rdzv_backend c10d: on aws_batch"),
    "no rendezvous": ({"rdzv_backend": None, "rdzv_endpoint": None}, "queue=q",
                      "--rdzv_backend c10d: on aws_batch"),
    "etcd3 without endpoint": ({"rdzv_endpoint": None}, "queue=q", "--rdzv_backend etcd3 needs --rdzv_endpoint"),
    "no run id": ({"run_id": None}, "queue=q", "--run_id: required on aws_batch"),
    "attempts 11": ({}, "queue=q,attempts=11", "-cfg attempts=11: AWS Batch allows 1 to 10 attempts"),
    "secret without arn": ({}, "queue=q,secrets=ELASTIC_FT_ETCD_PASSWORD", "-cfg secrets: 'ELASTIC_FT_ETCD_PASSWORD' is not NAME:ARN"),
}


def _refused(args: list[str], cfg: str):
    proc = torchx("run", "-s", "aws_batch", "--dryrun", "-cfg", cfg, "elastic_ft.train", *args)
    assert proc.returncode != 0, explain(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, explain(proc)
    assert "=== SCHEDULER REQUEST ===" not in proc.stdout, explain(proc)
    return proc


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_naming_the_argument(case):
    options, cfg, line = CASES[case]
    proc = _refused(train_args(**options), cfg)
    hits = [text for text in proc.stderr.splitlines() if line in text]
    assert len(hits) == 1, explain(proc)


def test_every_problem_is_listed_once():
    """One run shows all that must change, one line each."""
    proc = _refused(["--nnodes", "2:8"], "queue=q")
    err = proc.stderr
    for start in ("--rdzv_backend c10d: on aws_batch", "--checkpoint_uri: a file:// URI", "--run_id: required"):
        assert sum(line.strip().startswith(start) for line in err.splitlines()) == 1, explain(proc)
