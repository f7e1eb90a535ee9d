"""The agent's secrets (the etcd password, the rendezvous state key) stay out of its workers.

A real torchrun agent on a real etcd with TLS and auth, logged in as a user
whose role may read and write only the rendezvous prefix (as infra/aws/etcd.yaml
sets it up): the worker reports which variables its environment holds, the
state in etcd is authenticated with the job's key, and the job completes.
"""

from __future__ import annotations

import itertools
import os

import pytest

from agents import child_env, read_jsonl, stop_leftovers, torchrun_agent
from elastic_ft.rendezvous.options import parse_options
from elastic_ft.rendezvous.state_codec import KEY_ENV, StateCodec, StateSecret

pytestmark = [pytest.mark.etcd, pytest.mark.torchrun, pytest.mark.slow]

PASSWORD_ENV = "EFT_TEST_ETCD_PASSWORD"
CONTROL_ENV = "EFT_TEST_CONTROL"  # an ordinary variable: the workers must still get it
KEY_PREFIX = "/elastic_ft/rendezvous"
_users = itertools.count()


def limited_user(etcd_tls) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """A user whose only role may read and write keys under /elastic_ft/ (etcd RBAC); root stays apart."""
    n = f"trainer-{os.getpid()}-{next(_users)}"
    password = f"pw-{n}-0123456789"
    etcd_tls.etcdctl("role", "add", n)
    etcd_tls.etcdctl("role", "grant-permission", n, "--prefix=true", "readwrite", "/elastic_ft/")
    etcd_tls.etcdctl("user", "add", f"{n}:{password}", "--interactive=false")
    etcd_tls.etcdctl("user", "grant-role", n, n)
    return n, password


def test_workers_get_neither_the_etcd_password_nor_the_state_key(etcd_tls, tls_files, run_id, tmp_path):
    user, password = limited_user(etcd_tls)
    state_key = "k" * 8 + os.urandom(16).hex()
    conf = ",".join([
        f"ca_cert={tls_files.ca_cert}", f"client_cert={tls_files.client_cert}",
        f"client_key={tls_files.client_key}", f"user={user}", f"password_env={PASSWORD_ENV}",
        f"key_prefix={KEY_PREFIX}", "last_call_timeout=1", "join_timeout=60",
    ])
    env = child_env(**{PASSWORD_ENV: password, KEY_ENV: state_key, CONTROL_ENV: "1"})
    job_args = tuple(arg for name in (PASSWORD_ENV, KEY_ENV, CONTROL_ENV) for arg in ("--report-env", name))
    agent = torchrun_agent(etcd_tls.endpoint, run_id, tmp_path, nproc=1, nnodes="1", steps=2, step_time=0.05,
                           max_restarts=0, conf=conf, job_args=job_args, env=env)
    try:
        assert agent.wait(timeout=120) == 0, agent.tail()
    finally:
        stop_leftovers([agent])
    workers = read_jsonl(tmp_path / "workers.jsonl")
    assert [w["env_present"] for w in workers] == [[CONTROL_ENV]], agent.tail()
    assert [s["step"] for s in read_jsonl(tmp_path / "steps.jsonl")] == [1, 2]
    # The state the agent left is authenticated with ELASTIC_FT_RDZV_KEY (it wins over the password).
    state_name = parse_options(etcd_tls.endpoint, {"key_prefix": KEY_PREFIX}).run_prefix(run_id) + "state"
    stored = etcd_tls.etcdctl("get", state_name, "--print-value-only").stdout.strip().encode()
    expected = StateCodec(StateSecret(state_key, KEY_ENV), state_name).key_id
    assert stored.startswith(b"eft-state/2:" + expected + b":"), stored[:80]
    assert password not in agent.tail(200_000) and state_key not in agent.tail(200_000)
