"""torchx's ``aws_batch`` scheduler, with ``elastic_ft.train`` apps submitted as Spot-ready array jobs.

Registered under ``aws_batch`` in the ``torchx.schedulers`` entry-point group
(see pyproject.toml). An app that carries the elastic_ft marker becomes an
array job of single-node containers (:mod:`.request`); its status, list,
cancel and logs read array parents and children (:mod:`.state`). Any other
app, and any job that is a multi-node parallel one, goes through torchx's
``AWSBatchScheduler`` unchanged.

torchx's private helpers are used in three places, each to keep behaviour
identical to torchx's rather than copied: ``_get_job`` (how a handle finds its
job), ``_stream_events`` (CloudWatch paging and tailing), and, in
:mod:`.request`, ``_role_to_node_properties`` (the container dict).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional

from torchx.schedulers.api import AppDryRunInfo, DescribeAppResponse, ListAppResponse, Stream, filter_regex
from torchx.schedulers.aws_batch_scheduler import TAG_TORCHX_VER, AWSBatchOpts, AWSBatchScheduler
from torchx.schedulers.ids import make_unique
from torchx.specs import AppDef, CfgVal, runopts

from elastic_ft.aws_batch import request as req
from elastic_ft.aws_batch import state
from elastic_ft.aws_batch.retry import DEFAULT_ATTEMPTS, MAX_ATTEMPTS

CANCEL_REASON = "killed via torchx CLI"  # torchx's own reason


class ElasticBatchOpts(AWSBatchOpts, total=False):
    attempts: int
    secrets: Optional[List[str]]


class ElasticBatchScheduler(AWSBatchScheduler):
    """``AWSBatchScheduler`` that submits elastic_ft apps as array jobs (see the module docstring)."""

    def _run_opts(self) -> runopts:
        opts = super()._run_opts()
        opts.add(
            "attempts",
            type_=int,
            default=DEFAULT_ATTEMPTS,
            help=f"elastic_ft.train only: runs per node (1 to {MAX_ATTEMPTS}); a node is retried when "
            "Spot reclaims its host or it leaves on a spot notice (exit 75), and fails on anything else",
        )
        opts.add(
            "secrets",
            type_=List[str],
            help="elastic_ft.train only: NAME:ARN items, ';'-separated: each node gets the variable NAME "
            "set from the Secrets Manager secret or SSM parameter ARN (read with execution_role_arn)",
        )
        return opts

    # ------------------------------------------------------------------ submit

    def _submit_dryrun(self, app: AppDef, cfg: ElasticBatchOpts) -> AppDryRunInfo:
        if not req.is_elastic_ft(app):
            return super()._submit_dryrun(app, cfg)
        req.check(app, cfg)  # before naming or images: nothing is planned for an app that cannot run
        name = make_unique(req.job_base_name(app, cfg.get("share_id")))
        images = self.dryrun_push_images(app, dict(cfg))
        return AppDryRunInfo(req.build(app, cfg, name=name, images_to_push=images), req.describe_request)

    def schedule(self, dryrun_info: AppDryRunInfo) -> str:
        request = dryrun_info.request
        if not isinstance(request, req.ArrayJobRequest):
            return super().schedule(dryrun_info)
        self.push_images(request.images_to_push)
        self._client.register_job_definition(**request.job_definition)
        self._client.submit_job(**request.submit_job)
        return f"{request.queue}:{request.name}"

    # ------------------------------------------------------------------ read

    def describe(self, app_id: str) -> Optional[DescribeAppResponse]:
        job = self._get_job(app_id)  # torchx's lookup by job name in the handle's queue
        if job is None:
            return None
        if "nodeProperties" in job:
            return super().describe(app_id)
        running = 0
        if state.array_size(job) and job.get("status") not in state.TERMINAL:
            running = self._running_children(job["jobId"])
        return DescribeAppResponse(
            app_id=app_id,
            state=state.app_state(job, running),
            roles=[state.role_of(job)],
            msg=state.summary_line(job),
        )

    def _running_children(self, job_id: str) -> int:
        """Children RUNNING now; the parent's status summary is only updated from time to time."""
        pages = self._client.get_paginator("list_jobs").paginate(arrayJobId=job_id, jobStatus="RUNNING")
        return sum(len(page["jobSummaryList"]) for page in pages)

    def list(self) -> List[ListAppResponse]:
        """torchx's jobs in every queue, array parents with their children's state; children are not apps."""
        apps = []
        for page in self._client.get_paginator("describe_job_queues").paginate():
            for queue in page["jobQueues"]:
                apps.extend(self._list_queue(queue["jobQueueName"]))
        return apps

    def _list_queue(self, queue: str) -> List[ListAppResponse]:
        # A filter makes list_jobs return jobs of every status (without one: RUNNING only),
        # as torchx's own list does.
        every_status = {"name": "AFTER_CREATED_AT", "values": ["1"]}
        apps = []
        pages = self._client.get_paginator("list_jobs").paginate(
            jobQueue=queue, filters=[every_status], PaginationConfig={"PageSize": state.DESCRIBE_BATCH}
        )
        for page in pages:
            ids = [summary["jobId"] for summary in page["jobSummaryList"]]
            if not ids:
                continue
            for job in self._client.describe_jobs(jobs=ids)["jobs"]:
                if TAG_TORCHX_VER in (job.get("tags") or {}) and not state.is_child(job):
                    apps.append(ListAppResponse(app_id=f"{queue}:{job['jobName']}", state=state.app_state(job)))
        return apps

    def _describe_children(self, job: Mapping[str, Any]) -> List[Dict[str, Any]]:
        children = []
        for batch in state.child_ids(job["jobId"], state.array_size(job)):
            children.extend(self._client.describe_jobs(jobs=batch)["jobs"])
        return children

    # ------------------------------------------------------------------ act

    def _cancel_existing(self, app_id: str) -> None:
        """Terminate the job and, for an array, every child that still runs or waits.

        Each unfinished child is terminated by id, so that cancel stops running
        children whatever Batch does with the children of a terminated parent.
        """
        job = self._get_job(app_id)
        if job is None or "nodeProperties" in job:
            return super()._cancel_existing(app_id)
        self._client.terminate_job(jobId=job["jobId"], reason=CANCEL_REASON)
        if state.array_size(job):
            for child_id in state.to_terminate(self._describe_children(job)):
                self._client.terminate_job(jobId=child_id, reason=CANCEL_REASON)

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: Optional[str] = None,
        since: Optional[datetime] = None,
        until: Optional[datetime] = None,
        should_tail: bool = False,
        streams: Optional[Stream] = None,
    ) -> Iterable[str]:
        """The log of node ``k``: array child ``JOBID:k`` (or the one container job, k=0)."""
        job = self._get_job(app_id)
        if job is None or "nodeProperties" in job:
            return super().log_iter(app_id, role_name, k, regex, since, until, should_tail, streams)
        if streams not in (None, Stream.COMBINED):
            raise ValueError("AWSBatchScheduler only supports COMBINED log stream")
        node = self._node(job, k)
        stream = state.log_stream(node) if node else None
        if not stream:
            return []
        events = self._stream_events(app_id, stream, since=since, until=until, should_tail=should_tail)
        return filter_regex(regex, events) if regex else events

    def _node(self, job: Mapping[str, Any], k: int) -> Optional[Mapping[str, Any]]:
        """The description of node ``k`` of ``job``; ValueError for a node the job does not have."""
        size = state.array_size(job) or 1
        if not 0 <= k < size:
            raise ValueError(f"node {k}: job {job['jobName']} has nodes 0 to {size - 1}")
        if size == 1:
            return job
        jobs = self._client.describe_jobs(jobs=[f"{job['jobId']}:{k}"])["jobs"]
        return jobs[0] if jobs else None


def create_scheduler(
    session_name: str,
    client: Optional[Any] = None,
    log_client: Optional[Any] = None,
    docker_client: Optional[Any] = None,
    **kwargs: CfgVal,
) -> ElasticBatchScheduler:
    """The ``aws_batch`` scheduler factory torchx calls as ``create_scheduler(session_name, **kwargs)``."""
    return ElasticBatchScheduler(
        session_name=session_name, client=client, log_client=log_client, docker_client=docker_client
    )
