"""The scheduler's calls against described array jobs: cancel stops every unfinished child, status
reads the children, logs read child ``JOBID:k``. A recording client stands in for boto3's."""

from __future__ import annotations

from typing import Any

import pytest
from torchx.specs import AppState

from elastic_ft.aws_batch import state
from elastic_ft.aws_batch.scheduler import ElasticBatchScheduler, create_scheduler

QUEUE, NAME, PARENT = "q", "elastic-ft-exp1-abc", "11111111-2222"
APP_ID = f"{QUEUE}:{NAME}"
CHILD_STATUSES = ["RUNNING", "SUCCEEDED", "RUNNABLE", "FAILED", "STARTING", "RUNNING"]


def _child(i: int, status: str) -> dict:
    return {
        "jobId": f"{PARENT}:{i}", "jobName": NAME, "status": status, "arrayProperties": {"index": i},
        "container": {"logStreamName": f"running/{i}"},
        "attempts": [{"container": {"logStreamName": f"attempt1/{i}"}}, {"container": {"logStreamName": f"last/{i}"}}],
    }


class FakeBatch:
    """The few batch calls the scheduler makes, over a parent array job and its children."""

    def __init__(self, statuses: list[str], parent_status: str = "PENDING") -> None:
        children = [_child(i, s) for i, s in enumerate(statuses)]
        summary = {s: statuses.count(s) for s in set(statuses)}
        summary["RUNNING"] = 0  # the summary lags: the children say more
        parent = {
            "jobId": PARENT, "jobArn": f"arn:aws:batch:us-east-1:1:job/{PARENT}", "jobName": NAME,
            "status": parent_status, "tags": {}, "arrayProperties": {"size": len(statuses), "statusSummary": summary},
            "container": {"image": "img", "command": ["bash", "-c", "torchrun"],
                          "environment": [{"name": "TORCHX_ROLE_NAME", "value": "trainer"}],
                          "resourceRequirements": [{"type": "VCPU", "value": "2"}, {"type": "MEMORY", "value": "8"}]},
        }
        self.jobs = {j["jobId"]: j for j in [parent, *children]}
        self.terminated: list[str] = []
        self.described: list[list[str]] = []

    def get_paginator(self, name: str) -> "FakeBatch":
        assert name == "list_jobs"
        return self

    def paginate(self, **kw: Any):
        if "arrayJobId" in kw:
            yield {"jobSummaryList": [{"jobId": j["jobId"]} for j in self.jobs.values()
                                      if j["jobId"].startswith(f"{kw['arrayJobId']}:") and j["status"] == kw["jobStatus"]]}
        else:
            yield {"jobSummaryList": [{"jobArn": self.jobs[PARENT]["jobArn"], "jobId": PARENT}]}

    def describe_jobs(self, jobs: list[str]) -> dict:
        self.described.append(jobs)
        by_arn = {j.get("jobArn"): j for j in self.jobs.values()}
        return {"jobs": [self.jobs.get(i) or by_arn[i] for i in jobs if i in self.jobs or i in by_arn]}

    def terminate_job(self, jobId: str, reason: str) -> None:
        self.terminated.append(jobId)


class FakeLogs:
    def __init__(self) -> None:
        self.streams: list[str] = []

    def get_log_events(self, logGroupName: str, logStreamName: str, **kw: Any) -> dict:
        self.streams.append(logStreamName)
        token = kw.get("nextToken")
        events = [] if token else [{"timestamp": 1, "message": f"hello from {logStreamName}"}]
        return {"nextForwardToken": "end", "events": events}


def _scheduler(client: FakeBatch, logs: FakeLogs | None = None) -> ElasticBatchScheduler:
    return create_scheduler("test", client=client, log_client=logs or FakeLogs())


def test_cancel_terminates_the_parent_and_every_unfinished_child():
    client = FakeBatch(CHILD_STATUSES)
    _scheduler(client).cancel(APP_ID)
    assert client.terminated == [PARENT, f"{PARENT}:0", f"{PARENT}:2", f"{PARENT}:4", f"{PARENT}:5"]


def test_cancel_describes_children_100_at_a_time():
    client = FakeBatch(["RUNNING"] * 250)
    _scheduler(client).cancel(APP_ID)
    child_batches = [ids for ids in client.described if ids[0].startswith(f"{PARENT}:")]
    assert [len(ids) for ids in child_batches] == [100, 100, 50]
    assert len(client.terminated) == 251


def test_status_is_running_while_a_child_runs_though_the_parent_reads_pending():
    described = _scheduler(FakeBatch(CHILD_STATUSES)).describe(APP_ID)
    assert described.state == AppState.RUNNING
    assert described.roles[0].name == "trainer" and described.roles[0].num_replicas == len(CHILD_STATUSES)


@pytest.mark.parametrize(
    "parent, children, expected",
    [
        ("PENDING", ["RUNNABLE", "STARTING"], AppState.PENDING),
        ("PENDING", ["RUNNABLE", "RUNNING"], AppState.RUNNING),
        ("SUCCEEDED", ["SUCCEEDED"] * 2, AppState.SUCCEEDED),
        ("FAILED", ["SUCCEEDED", "FAILED"], AppState.FAILED),
    ],
)
def test_status_from_parent_and_children(parent, children, expected):
    assert _scheduler(FakeBatch(children, parent_status=parent)).describe(APP_ID).state == expected


def test_log_of_node_k_reads_child_k():
    logs = FakeLogs()
    lines = list(_scheduler(FakeBatch(CHILD_STATUSES), logs).log_iter(APP_ID, "trainer", 1))
    assert lines == ["hello from last/1\n"]  # finished: its last attempt's stream
    lines = list(_scheduler(FakeBatch(CHILD_STATUSES), logs).log_iter(APP_ID, "trainer", 0))
    assert lines == ["hello from running/0\n"]
    with pytest.raises(ValueError, match="node 6: job elastic-ft-exp1-abc has nodes 0 to 5"):
        _scheduler(FakeBatch(CHILD_STATUSES), logs).log_iter(APP_ID, "trainer", 6)


def test_state_reading_is_pure():
    parent = {"status": "PENDING", "arrayProperties": {"size": 3, "statusSummary": {"RUNNING": 2, "SUCCEEDED": 1}}}
    assert state.app_state(parent) == AppState.RUNNING
    assert state.summary_line(parent) == "nodes: 2 RUNNING, 1 SUCCEEDED"
    assert state.to_terminate([{"jobId": "a", "status": "SUBMITTED"}, {"jobId": "b", "status": "FAILED"}]) == ["a"]
    assert state.log_stream({"status": "FAILED", "attempts": []}) is None
    assert state.array_size({"arrayProperties": {"index": 3}}) == 0
