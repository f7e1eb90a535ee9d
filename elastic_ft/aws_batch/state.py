"""Reading AWS Batch's job descriptions of an elastic_ft job (pure: ``describe_jobs`` output in).

An array parent's own status never reads RUNNING (it stays PENDING while its
children run, then turns SUCCEEDED or FAILED), so the app's state comes from
the children (``arrayProperties.statusSummary``, and a count of running
children where that summary lags). Children are addressed ``JOBID:INDEX``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional

from torchx.schedulers import aws_batch_scheduler as stock
from torchx.specs import MISSING, NULL_RESOURCE, AppState, Role

TERMINAL = frozenset({"SUCCEEDED", "FAILED"})
DESCRIBE_BATCH = 100  # describe_jobs takes at most 100 job ids


def array_size(job: Mapping[str, Any]) -> int:
    """The number of children of an array parent; 0 for a plain job or a child."""
    props = job.get("arrayProperties") or {}
    return int(props.get("size", 0)) if "index" not in props else 0


def is_child(job: Mapping[str, Any]) -> bool:
    """Whether ``job`` is an array child (its arrayProperties has an index)."""
    return "index" in (job.get("arrayProperties") or {})


def app_state(job: Mapping[str, Any], running_children: int = 0) -> AppState:
    """The torchx state of a container job or array parent.

    A terminal parent maps as torchx maps any job; otherwise any running child
    (in the status summary, or counted by the caller) makes the app RUNNING.
    """
    status = job.get("status", "")
    summary = (job.get("arrayProperties") or {}).get("statusSummary") or {}
    if status not in TERMINAL and (running_children > 0 or summary.get("RUNNING", 0) > 0):
        return AppState.RUNNING
    return stock.JOB_STATE.get(status, AppState.UNKNOWN)


def summary_line(job: Mapping[str, Any]) -> str:
    """``"nodes: 3 RUNNING, 5 SUCCEEDED"`` for an array parent, from its status summary; else ``""``."""
    summary = (job.get("arrayProperties") or {}).get("statusSummary") or {}
    counts = [f"{n} {status}" for status, n in sorted(summary.items()) if n]
    return f"nodes: {', '.join(counts)}" if counts else ""


def child_ids(job_id: str, size: int) -> List[List[str]]:
    """The children's ids, ``JOBID:0`` .. ``JOBID:SIZE-1``, in batches ``describe_jobs`` accepts."""
    ids = [f"{job_id}:{i}" for i in range(size)]
    return [ids[i : i + DESCRIBE_BATCH] for i in range(0, len(ids), DESCRIBE_BATCH)]


def to_terminate(children: Iterable[Mapping[str, Any]]) -> List[str]:
    """The ids of the children that still run or wait (not SUCCEEDED or FAILED): cancel stops each."""
    return [c["jobId"] for c in children if c.get("status") not in TERMINAL]


def log_stream(job: Mapping[str, Any]) -> Optional[str]:
    """The CloudWatch log stream of a node: the running container's, else its last attempt's."""
    if job.get("status") == "RUNNING":
        return (job.get("container") or {}).get("logStreamName")
    attempts = job.get("attempts") or []
    if not attempts:
        return None
    return (attempts[-1].get("container") or {}).get("logStreamName")


def role_of(job: Mapping[str, Any]) -> Role:
    """The app's one role, read back from the job's container (as torchx reads a node group)."""
    container = job.get("container") or job.get("containerProperties") or {}
    env: Dict[str, str] = {e["name"]: e["value"] for e in container.get("environment", [])}
    command = container.get("command") or []
    resources = container.get("resourceRequirements") or []
    return Role(
        name=env.get(stock.ENV_TORCHX_ROLE_NAME, stock.DEFAULT_ROLE_NAME),
        image=container.get("image", ""),
        entrypoint=command[0] if command else MISSING,
        args=list(command[1:]),
        env=env,
        num_replicas=array_size(job) or 1,
        resource=stock.resource_from_resource_requirements(resources) if resources else NULL_RESOURCE,
    )
