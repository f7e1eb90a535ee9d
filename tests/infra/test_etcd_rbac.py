"""The etcd template's RBAC set-up, run as written against a real etcd.

The boot script's ``etcd RBAC`` block (infra/aws/etcd.yaml) runs with bash and
etcdctl on a local etcd, ``aws`` replaced by a function that prints the
passwords: afterwards the training user reads and writes only under the
prefix and can change no users or roles, root can, and a boot that failed
half-way runs the block again to the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cfn_checks as checks
from conftest import REPO, load_template

sys.path.insert(0, str(REPO / "tests" / "rendezvous"))
from etcd_server import ETCDCTL, EtcdServer  # noqa: E402

pytestmark = [pytest.mark.etcd, pytest.mark.infra]

if shutil.which("etcd") is None:
    pytest.skip("etcd is not installed: run scripts/setup.sh --test (Debian package etcd-server).",
                allow_module_level=True)

ROOT_PW = "root-pw-0123456789"
TRAINING_PW = "training-pw-0123456789"


def rbac_block() -> str:
    text = checks.etcd_user_data(load_template("etcd"))
    block = text.split("# etcd RBAC: begin\n", 1)[1].split("# etcd RBAC: end\n", 1)[0]
    subs = {"${EtcdRootPasswordSecretArn}": "arn:root", "${EtcdPasswordSecretArn}": "arn:training",
            "${TrainingKeyPrefix}": "/elastic_ft/"}
    for name, value in subs.items():
        block = block.replace(name, value)
    assert "${" not in block, block
    return block


def run_block(etcd: EtcdServer, *, training_secret_fails: bool = False) -> subprocess.CompletedProcess:
    # Secrets Manager stands in as a function: the password of the --secret-id given, on stdout.
    fail = "exit 1" if training_secret_fails else f"printf %s '{TRAINING_PW}'"
    script = "\n".join([
        "set -euo pipefail",
        f"etcdctl() {{ '{ETCDCTL}' \"$@\"; }}",
        "aws() { case \"$*\" in",
        f"  *arn:root*) printf %s '{ROOT_PW}' ;;",
        f"  *arn:training*) {fail} ;;",
        "  *) echo \"unexpected aws $*\" >&2; exit 2 ;; esac; }",
        "MEMBER=etcd-0",
        rbac_block(),
    ])
    env = dict(os.environ, ETCDCTL_API="3", ETCDCTL_ENDPOINTS=f"http://{etcd.endpoint}", ETCDCTL_DIAL_TIMEOUT="2s")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)


def as_user(etcd: EtcdServer, user: str, password: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [ETCDCTL, f"--endpoints=http://{etcd.endpoint}", "--dial-timeout=2s", f"--user={user}:{password}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"), timeout=30)


def test_the_template_limits_the_training_user_to_its_prefix(tmp_path: Path):
    etcd = EtcdServer(tmp_path / "etcd-data").start()
    try:
        # A first boot that fails half-way (root made, the training secret unreadable) ...
        first = run_block(etcd, training_secret_fails=True)
        assert first.returncode != 0
        # ... and the replacement's boot runs the block to the end.
        again = run_block(etcd)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "Authentication Enabled" in again.stdout

        def ok(result: subprocess.CompletedProcess) -> bool:
            return result.returncode == 0

        assert ok(as_user(etcd, "training", TRAINING_PW, "put", "/elastic_ft/rendezvous/r/state", "v"))
        assert as_user(etcd, "training", TRAINING_PW, "get", "/elastic_ft/rendezvous/r/state",
                       "--print-value-only").stdout.strip() == "v"
        for args in (("put", "/other/key", "v"), ("get", "/other/key"), ("put", "/elastic_ft0", "v"),
                     ("user", "list"), ("role", "add", "wider"), ("user", "grant-role", "training", "root"),
                     ("auth", "disable")):
            result = as_user(etcd, "training", TRAINING_PW, *args)
            assert not ok(result) and "permission denied" in result.stderr, (args, result.stdout, result.stderr)
        assert ok(as_user(etcd, "root", ROOT_PW, "put", "/other/key", "v"))
        roles = as_user(etcd, "root", ROOT_PW, "user", "get", "training").stdout
        assert roles.split("Roles:")[1].split() == ["training"]
        # Once auth is on, another boot leaves it as it is.
        assert run_block(etcd).returncode == 0
        assert not ok(as_user(etcd, "training", TRAINING_PW, "put", "/other/key", "v"))
    finally:
        etcd.stop()
