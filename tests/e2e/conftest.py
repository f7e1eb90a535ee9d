"""Fixtures for the end-to-end tests: a run trained in this process, reused read-only."""

from __future__ import annotations

import os

import pytest

from elastic_ft import worker
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun


def train(root: str, run_id: str, *overrides: str) -> int:
    """The worker's own entry point, in this process (world 1): exit code as the CLI returns it."""
    return worker.main(["--spec", DEFAULT_SPEC, "--run_id", run_id, "--checkpoint_uri", f"file://{root}",
                        "--log_dir", os.path.join(root, run_id, "logs"), *overrides])


@pytest.fixture(scope="session")
def committed_run(tmp_path_factory) -> str:
    """A run of 6 steps with checkpoints at 2, 4 and 6 (tests copy it before changing anything)."""
    root = str(tmp_path_factory.mktemp("committed"))
    assert train(root, "run", "steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=null") == 0
    return root


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory) -> str:
    """A two-rank torchrun run killed after step 5 and resumed by the same command, with TensorBoard on.

    The run directory (``<root>/run``, events in ``logs/``); shared read-only by the goodput, plot and
    TensorBoard tests, which would each pay for the same two attempts otherwise.
    """
    root = str(tmp_path_factory.mktemp("resumed"))
    logs = os.path.join(root, "run", "logs")
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{root}", "--log_dir", logs,
            "steps=6", "checkpoint.every_steps=2", "logging.every_steps=3", "logging.tensorboard=true"]
    # Rank 1 SIGKILLs itself after 5 steps: at most step 4 is committed, so step 5 at least is trained again.
    first = torchrun(2, args, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                              ELASTIC_FT_FAULTS="kill:rank=1,step=5"))
    assert first.returncode != 0, "the injected kill did not stop the first attempt"
    second = torchrun(2, args)
    assert second.returncode == 0, explain(second)
    return os.path.join(root, "run")
