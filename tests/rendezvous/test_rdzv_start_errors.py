"""A node whose rendezvous cannot start: one line on stderr and a status that says why, no traceback.

Real torchrun (and torchx ``local_cwd``) processes against an endpoint nobody serves and a real etcd with
auth on. Before, torchrun printed the chained tracebacks of the etcd client, the handler and its own
launcher (and torchx showed them again), and exited 1 as if the workers had failed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agents import GLOO_JOB, REPO, child_env
from etcd_server import ROOT_PASSWORD, EtcdServer

from elastic_ft.rendezvous.entry import CONFIG_EXIT_CODE, UNAVAILABLE_EXIT_CODE

pytestmark = [pytest.mark.torchrun, pytest.mark.etcd]

BIN = Path(sys.executable).parent
UNSERVED = "127.0.0.1:1"  # port 1: nothing listens, the connection is refused at once


def torchrun(endpoint: str, run_id: str, conf: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd3",
           "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf,
           str(GLOO_JOB), "--out", str(tmp_path), "--steps", "1"]
    return subprocess.run(cmd, cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=120)


def the_line(stderr: str) -> str:
    """The node's one line saying why it could not start; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "could not start on this node" in line]
    assert len(lines) == 1, stderr
    return lines[0]


def test_unreachable_etcd_ends_torchrun_with_one_line_and_status_69(run_id, tmp_path):
    done = torchrun(UNSERVED, run_id, "retry_timeout=2", tmp_path)
    line = the_line(done.stderr)
    assert done.returncode == UNAVAILABLE_EXIT_CODE, done.stderr
    assert f"no etcd endpoint ({UNSERVED}) answered" in line
    assert not (tmp_path / "workers.jsonl").exists()


def test_invalid_rendezvous_options_end_torchrun_with_one_line_and_status_78(run_id, tmp_path):
    done = torchrun(UNSERVED, run_id, "bogus=1,keep_alive_interval=-3", tmp_path)
    line = the_line(done.stderr)
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr
    assert "bogus: unknown option" in line and "keep_alive_interval" in line  # every problem, on the one line


@pytest.fixture(scope="module")
def etcd_auth(tmp_path_factory: pytest.TempPathFactory) -> EtcdServer:
    server = EtcdServer(tmp_path_factory.mktemp("etcd-auth") / "data").start()
    try:
        server.enable_auth(ROOT_PASSWORD)
        yield server
    finally:
        server.stop()


def test_wrong_etcd_password_ends_torchrun_with_one_line_and_status_78(etcd_auth, run_id, tmp_path):
    conf = "user=root,password_env=RDZV_TEST_PASSWORD,insecure_auth=true,retry_timeout=2"
    done = torchrun(etcd_auth.endpoint, run_id, conf, tmp_path, RDZV_TEST_PASSWORD="not-" + ROOT_PASSWORD)
    line = the_line(done.stderr)
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr
    assert "user and password" in line
    assert ROOT_PASSWORD not in done.stderr + done.stdout


@pytest.mark.slow
def test_unreachable_etcd_through_torchx_local_cwd_shows_no_traceback(run_id, tmp_path):
    cmd = [str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}",
           "elastic_ft.train", "--nnodes", "1", "--nproc_per_node", "1", "--rdzv_backend", "etcd3",
           "--rdzv_endpoint", UNSERVED, "--rdzv_conf", "retry_timeout=2", "--run_id", run_id,
           "--checkpoint_uri", f"file://{tmp_path / 'runs'}", "--", "steps=1"]
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    assert f"no etcd endpoint ({UNSERVED}) answered" in the_line(output)
