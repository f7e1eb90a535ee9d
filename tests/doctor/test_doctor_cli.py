"""``python -m elastic_ft.cli doctor`` end to end, as a user runs it: its lines and its exit status."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from elastic_ft.spot.imds import ENDPOINT_ENV
from tests.conftest import REPO, process_env
from tests.ports import free_port

pytestmark = pytest.mark.subprocess  # `elastic-ft doctor` as a user runs it


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = process_env(**{ENDPOINT_ENV: f"http://127.0.0.1:{free_port()}", "MASTER_PORT": str(free_port()), **env})
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR"):
        environ.pop(name, None)
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "elastic_ft.cli", "doctor", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=120)


def _statuses(stdout: str) -> dict[str, str]:
    """check name -> status, from lines ``STATUS name: ...``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert all(re.match(r"(PASS|FAIL|WARN|SKIP) +\S+: ", line) for line in lines), stdout
    return {line.split()[1].rstrip(":"): line.split()[0] for line in lines}


def test_a_healthy_node_passes_every_check_and_exits_0(etcd, run_id, tmp_path):
    proc = _doctor("--hostname", "192.0.2.10", "--nnodes", "1:4", "--rdzv_endpoint", etcd.endpoint,
                   "--run_id", run_id, "--checkpoint_uri", f"file://{tmp_path}", "--post", GLOO_SOCKET_IFNAME="lo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _statuses(proc.stdout) == {
        "hostname": "PASS", "GLOO_SOCKET_IFNAME": "PASS", "rdzv_port": "PASS", "rendezvous": "PASS",
        "versions": "PASS", "master_port": "PASS", "checkpoint_store": "PASS", "clock": "SKIP", "imds": "PASS",
    }
    assert "1 node(s) agree: torch " in proc.stdout


def test_the_classic_failures_each_fail_with_a_fix_and_exit_1(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    (tmp_path / "a-file").write_text("")  # a checkpoint directory under a file cannot be written, even by root
    proc = _doctor("--hostname", "127.0.1.1", "--nnodes", "2", "--rdzv_endpoint", dead, "--run_id", "r1",
                   "--checkpoint_uri", f"file://{tmp_path}/a-file/x", GLOO_SOCKET_IFNAME="nosuch0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    statuses = _statuses(proc.stdout)
    failing = ("hostname", "GLOO_SOCKET_IFNAME", "rdzv_port", "rendezvous", "checkpoint_store")
    assert {k: statuses[k] for k in failing} == dict.fromkeys(failing, "FAIL")
    assert statuses["versions"] == "SKIP"
    for line in proc.stdout.splitlines():
        if line.startswith("FAIL"):
            assert "; fix: " in line, line
    assert "nosuch0" in proc.stdout and "127.0.1.1" in proc.stdout and dead in proc.stdout
    assert proc.stderr == "", proc.stderr  # the etcd client's retry warnings stay quiet


def test_without_arguments_the_remote_checks_skip():
    proc = _doctor("--hostname", "192.0.2.10")
    statuses = _statuses(proc.stdout)
    assert statuses["rendezvous"] == statuses["checkpoint_store"] == "SKIP"
    assert proc.returncode == 0, proc.stdout


def test_the_subcommand_module_imports_nothing_heavy():
    code = "import sys, elastic_ft.doctor.command; print(sorted(m for m in ('torch', 'boto3', 'grpc') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=process_env(), capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_bad_nnodes_is_refused_by_argparse():
    proc = _doctor("--nnodes", "two")
    assert proc.returncode == 2 and "argument --nnodes: 'two' must be N or MIN:MAX" in proc.stderr
