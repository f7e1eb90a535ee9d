"""The instance metadata service: on EC2 it answers (instance type, any spot notice); elsewhere it is absent.

Absence is a pass: the job runs anywhere, and the spot watcher then only has
SIGTERM. What is worth a line is a service that answers badly (a proxy in the
way: the watcher would miss the 2-minute notice) or a notice already pending.
"""

from __future__ import annotations

import datetime
from typing import Mapping

from elastic_ft.preflight.report import Result

INSTANCE_TYPE_PATH = "/latest/meta-data/instance-type"


def imds_result(endpoint: str, *, absent: str | None = None, error: str | None = None,
                instance_type: str | None = None, action: object = None) -> Result:
    """Decide from what IMDS at ``endpoint`` gave: ``absent`` (why nothing answered), ``error``, or its answers."""
    name = "imds"
    if absent is not None:
        return Result("PASS", name, f"not on EC2: {absent}")
    if error is not None:
        return Result("WARN", name, f"{endpoint} answered, but not as IMDSv2 does: {error}",
                      "unset http_proxy for 169.254.169.254 (NO_PROXY) or set ELASTIC_FT_IMDS_ENDPOINT correctly; "
                      "without it spot notices are missed")
    found = f"on EC2 ({instance_type or 'instance type unknown'}) via {endpoint}"
    if action is None:
        return Result("PASS", name, f"{found}; no spot notice")
    when = getattr(action, "time", None)
    at = datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%H:%M:%S UTC") if when else "soon"
    return Result("WARN", name, f"{found}; spot notice pending: {getattr(action, 'action', '?')} at {at}",
                  "this node is about to be taken: run the job on another node")


def check_imds(environ: Mapping[str, str], timeout_s: float = 1.0) -> Result:
    from elastic_ft.spot.imds import EndpointError, ImdsClient, ImdsError, ImdsUnavailable, endpoint_from_env

    try:
        endpoint = endpoint_from_env(environ)
    except EndpointError as exc:
        return Result("FAIL", "imds", str(exc), "fix or unset ELASTIC_FT_IMDS_ENDPOINT")
    client = ImdsClient(endpoint, timeout_s=timeout_s)
    try:
        return imds_result(endpoint, instance_type=client.metadata(INSTANCE_TYPE_PATH),
                           action=client.instance_action())
    except ImdsUnavailable as exc:
        return imds_result(endpoint, absent=str(exc))
    except ImdsError as exc:
        return imds_result(endpoint, error=str(exc))
