"""Submit, status, list and cancel through the real ``torchx`` CLI against AWS Batch served by moto.

``moto_server`` runs as a subprocess on a free port of 127.0.0.1, with Docker
off (jobs succeed as soon as they are submitted, so moto cannot show a
running child being cancelled: test_scheduler_calls.py does, with described
children). The CLI reaches it through the standard AWS variables only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request

import boto3
import pytest

from tests.aws_batch.conftest import RUN_ID, torchx, train_args
from tests.conftest import BIN, explain, process_env
from tests.waiting import wait_until

pytestmark = pytest.mark.torchrun  # the torchx CLI (moto_server: the `moto` fixture)

QUEUE = "spot-q"


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """``(endpoint, env)``: moto's batch with a compute environment and a queue, and a CLI environment."""
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    log = open(log_path, "w")
    # Port 0: the server binds a free port itself and prints it ("Running on http://127.0.0.1:PORT").
    proc = subprocess.Popen([os.path.join(BIN, "moto_server"), "-H", "127.0.0.1", "-p", "0"],
                            stdout=log, stderr=subprocess.STDOUT)

    def running() -> None:
        if proc.poll() is not None:
            raise AssertionError(f"moto_server exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")

    try:
        found = wait_until(lambda: re.search(r"Running on (http://127\.0\.0\.1:\d+)", log_path.read_text()),
                           timeout=30, what="moto_server to print its address", check=running)
        endpoint = found.group(1)
        wait_until(lambda: urllib.request.urlopen(f"{endpoint}/moto-api/data.json", timeout=2).status == 200,
                   timeout=30, what="moto_server answering", retry_on=(OSError,), check=running)
        config = urllib.request.Request(
            f"{endpoint}/moto-api/config", data=json.dumps({"batch": {"use_docker": False}}).encode(),
            method="POST", headers={"Content-Type": "application/json"},
        )
        assert json.load(urllib.request.urlopen(config, timeout=5))["batch"]["use_docker"] is False
        _create_queue(endpoint)
        tmp = tmp_path_factory.mktemp("aws")
        env = process_env(
            AWS_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL_BATCH=endpoint, AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE=str(tmp / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp / "none"),
        )
        env.pop("AWS_PROFILE", None)
        yield endpoint, env
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _client(endpoint: str, service: str = "batch"):
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _create_queue(endpoint: str) -> None:
    role = _client(endpoint, "iam").create_role(RoleName="batch-service", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    batch = _client(endpoint)
    ce = batch.create_compute_environment(
        computeEnvironmentName="spot", type="UNMANAGED", state="ENABLED", serviceRole=role,
    )["computeEnvironmentArn"]
    batch.create_job_queue(jobQueueName=QUEUE, state="ENABLED", priority=1,
                           computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}])


def _submit(env, **options) -> str:
    proc = torchx("run", "-s", "aws_batch", "-cfg", f"queue={QUEUE}", "elastic_ft.train",
                  *train_args(**options), env=env)
    assert proc.returncode == 0, explain(proc)
    handles = [line for line in proc.stdout.splitlines() if line.startswith("aws_batch://")]
    assert len(handles) == 1, explain(proc)
    return handles[0]


def _parent(batch, name: str) -> dict:
    summaries = batch.list_jobs(jobQueue=QUEUE, filters=[{"name": "JOB_NAME", "values": [name]}])["jobSummaryList"]
    return batch.describe_jobs(jobs=[summaries[0]["jobId"]])["jobs"][0]


def test_submit_registers_a_container_definition_and_an_array_of_8(moto):
    endpoint, env = moto
    handle = _submit(env)
    name = handle.rsplit(":", 1)[1]
    batch = _client(endpoint)
    definition = batch.describe_job_definitions(jobDefinitionName=name)["jobDefinitions"][0]
    assert definition["type"] == "container"
    command = definition["containerProperties"]["command"]
    assert command[:2] == ["bash", "-c"] and command[2].startswith("torchrun --rdzv_backend etcd3 ")
    assert f"--rdzv_id {RUN_ID} --nnodes 2:8 " in command[2]
    parent = _parent(batch, name)
    assert parent["arrayProperties"]["size"] == 8
    ids = [f"{parent['jobId']}:{i}" for i in range(8)]
    assert sorted(c["jobId"] for c in batch.describe_jobs(jobs=ids)["jobs"]) == sorted(ids)
    assert batch.describe_jobs(jobs=[f"{parent['jobId']}:8"])["jobs"] == []


def test_status_list_and_cancel_answer_for_the_array_job(moto):
    endpoint, env = moto
    handle = _submit(env)
    status = torchx("status", handle, env=env)
    assert status.returncode == 0, explain(status)
    state = [line.split(":", 1)[1].strip() for line in status.stdout.splitlines() if "State:" in line]
    assert state and state[0] in {"PENDING", "RUNNING", "SUCCEEDED"}, explain(status)
    assert "nodes: " in status.stdout, explain(status)
    listed = torchx("list", "-s", "aws_batch", env=env)
    assert listed.returncode == 0, explain(listed)
    assert handle in listed.stdout, explain(listed)
    assert sum(handle.rsplit(":", 1)[1] in line for line in listed.stdout.splitlines()) == 1, "children are not apps"
    cancel = torchx("cancel", handle, env=env)
    assert cancel.returncode == 0, explain(cancel)
    assert "Traceback" not in cancel.stderr


def test_one_node_is_a_plain_container_job(moto):
    endpoint, env = moto
    handle = _submit(env, nnodes="1")
    parent = _parent(_client(endpoint), handle.rsplit(":", 1)[1])
    assert "size" not in (parent.get("arrayProperties") or {})
    status = torchx("status", handle, env=env)
    assert status.returncode == 0 and "State:" in status.stdout, explain(status)


def test_status_of_an_unknown_job(moto):
    _endpoint, env = moto
    status = torchx("status", f"aws_batch://torchx/{QUEUE}:no-such-job", env=env)
    assert "Traceback" not in status.stderr, explain(status)


def test_log_of_a_node_answers(moto):
    """moto keeps no container logs: the log of node 3 reads child JOBID:3 and is empty, without error."""
    _endpoint, env = moto
    handle = _submit(env)
    log = torchx("log", f"{handle}/trainer/3", env=env)
    assert log.returncode == 0, explain(log)
    assert "Traceback" not in log.stderr, explain(log)
