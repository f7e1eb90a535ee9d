"""Shared helpers for tests that launch real processes (torchrun, torchx, the CLI)."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from tests.process_guard import (  # noqa: F401  (hooks: pytest finds them in this module)
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport, pytest_runtest_protocol,
    pytest_unconfigure,
)
from tests.servers import etcd, etcd_tls, moto, s3_servers, seaweed, seaweedfs, tls_files  # noqa: F401  (fixtures)

# Every worker polls the instance metadata service for spot notices. Tests send
# traffic to 127.0.0.1 only: a closed local port reads as "not on EC2" at once.
# Tests of the notices serve their own IMDS and set the endpoint themselves.
os.environ.setdefault("ELASTIC_FT_IMDS_ENDPOINT", "http://127.0.0.1:1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
DEFAULT_SPEC = os.path.join(REPO, "specs", "tiny-lora.yaml")


def process_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: the venv's tools first on PATH, no inherited faults."""
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("ELASTIC_FT_FAULTS", None)
    env.update(extra)
    return env


def run(cmd: list[str], *, timeout: float = 300, env: dict | None = None, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env or process_env(), capture_output=True, text=True, timeout=timeout)


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``elastic-ft ARGS`` as a user would run it."""
    return run([sys.executable, "-m", "elastic_ft.cli", *args], timeout=timeout, env=env)


def torchrun(nproc: int, worker_args: list[str], *, max_restarts: int = 0, env: dict | None = None,
             timeout: float = 400) -> subprocess.CompletedProcess:
    """One single-node torchrun job of ``elastic_ft.worker``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), "-m", "elastic_ft.worker", *worker_args,
    ]
    return run(cmd, env=env or process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), timeout=timeout)


def tree_digest(root: str) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path: proof that nothing was touched."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


@pytest.fixture
def run_root(tmp_path) -> str:
    """A checkpoint root for one test, as a file:// URI base."""
    root = tmp_path / "runs"
    root.mkdir()
    return str(root)


def png_size(path: str) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG: {head[:8]!r}"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])
