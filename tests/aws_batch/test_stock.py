"""Registering ``aws_batch`` leaves torchx as it was for everything that is not elastic_ft.train: every
default scheduler is still there and torchx's own, and other apps plan exactly torchx's requests."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib.metadata import entry_points

import pytest
from torchx.runner import get_runner
from torchx.schedulers import DEFAULT_SCHEDULER_MODULES, get_scheduler_factories
from torchx.schedulers.aws_batch_scheduler import AWSBatchScheduler, BatchJob
from torchx.schedulers.local_scheduler import LocalScheduler

from elastic_ft.aws_batch.scheduler import ElasticBatchScheduler
from tests.aws_batch.conftest import dryrun, torchx
from tests.conftest import explain

STOCK_APPS = {
    "dist.ddp": ["-j", "2x2", "--script", "train.py", "--", "--lr", "0.1"],
    "utils.echo": ["--msg", "hello"],
}


def test_every_default_scheduler_is_registered_and_torchx_own():
    eps = {ep.name: ep for ep in entry_points(group="torchx.schedulers")}
    assert set(DEFAULT_SCHEDULER_MODULES) <= set(get_scheduler_factories())
    for name, module in DEFAULT_SCHEDULER_MODULES.items():
        want = "elastic_ft.aws_batch.scheduler" if name == "aws_batch" else module
        assert (eps[name].module, eps[name].attr) == (want, "create_scheduler"), name


def test_factories_build_torchx_schedulers():
    factories = get_scheduler_factories()
    assert isinstance(factories["local_cwd"]("test"), LocalScheduler)
    batch = factories["aws_batch"]("test")
    assert isinstance(batch, ElasticBatchScheduler) and isinstance(batch, AWSBatchScheduler)


def _normalized(request: BatchJob) -> dict:
    """The request with its unique name (random suffix) replaced by NAME."""
    return json.loads(json.dumps(asdict(request)).replace(request.name, "NAME"))


@pytest.mark.parametrize("component", sorted(STOCK_APPS))
def test_other_apps_plan_exactly_what_torchx_plans(component):
    info = dryrun(STOCK_APPS[component], component=component, share_id="team", priority=3)
    ours = info.request
    assert isinstance(ours, BatchJob) and ours.job_def["type"] == "multinode"
    stock = AWSBatchScheduler("torchx").submit_dryrun(info._app, {"queue": "q", "share_id": "team", "priority": 3})
    assert _normalized(ours) == _normalized(stock.request)
    assert str(info).replace(ours.name, "NAME") == str(stock).replace(stock.request.name, "NAME")


def test_other_apps_describe_as_torchx_does():
    """A multi-node job is described by torchx's own code (ours would read no nodeProperties)."""
    node = {"targetNodes": "0:1", "container": {"image": "img", "command": ["python", "-m", "x"], "environment": [
        {"name": "TORCHX_ROLE_NAME", "value": "worker"}], "resourceRequirements": [
        {"type": "VCPU", "value": "1"}, {"type": "MEMORY", "value": "1024"}]}}
    job = {"jobId": "j", "jobArn": "arn:aws:batch:us-east-1:1:job/j", "jobName": "ddp-x", "status": "RUNNING",
           "tags": {}, "nodeProperties": {"numNodes": 2, "mainNode": 0, "nodeRangeProperties": [node]}}

    class Client:
        def get_paginator(self, name):
            return self

        def paginate(self, **kw):
            yield {"jobSummaryList": [{"jobArn": job["jobArn"]}]}

        def describe_jobs(self, jobs):
            return {"jobs": [job]}

    ours = ElasticBatchScheduler("t", client=Client()).describe("q:ddp-x")
    assert ours == AWSBatchScheduler("t", client=Client()).describe("q:ddp-x")
    assert ours.roles[0].num_replicas == 2 and ours.state.name == "RUNNING"


@pytest.mark.torchrun
def test_stock_components_on_local_cwd(tmp_path):
    with get_runner() as runner:
        ddp = runner.dryrun_component("dist.ddp", STOCK_APPS["dist.ddp"], "local_cwd", cfg={})
    assert ddp.request is not None and "elastic_ft" not in str(ddp)
    proc = torchx("run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path}", "utils.echo", "--msg", "hello-stock")
    assert proc.returncode == 0, explain(proc)
    logs = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert "hello-stock" in logs, explain(proc)
