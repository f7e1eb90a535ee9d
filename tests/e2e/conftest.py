"""Fixtures for the end-to-end tests: a run trained in this process, reused read-only."""

from __future__ import annotations

import os

import pytest

from elastic_ft import worker
from tests.conftest import DEFAULT_SPEC


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
