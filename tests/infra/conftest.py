"""Paths and loaders shared by the infrastructure tests (templates, Dockerfile, lint tools)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AWS = REPO / "infra" / "aws"
TEMPLATES = ("storage", "network", "batch", "etcd")
BIN = Path(sys.executable).parent


def load_template(name: str) -> dict:
    """A template as a fresh mapping, through cfn-lint's loader (it reads !Ref, !Sub, ... tags)."""
    from cfnlint.decode import cfn_yaml

    return cfn_yaml.load(str(AWS / f"{name}.yaml"))


def tool(name: str) -> str:
    """A lint tool of the test extras, from this venv; the test fails (not skips) without it."""
    path = BIN / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{name} is not installed in {BIN}: install the test extras (pip install -e '.[test]')")
    return str(path)
