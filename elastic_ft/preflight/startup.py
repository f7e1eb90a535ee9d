"""The doctor's fast checks at the start of a multi-node job: warnings in the agent's log, never a failure.

Run by the etcd3 rendezvous handler as torchrun's agent builds it, once per
node, before the first round: the hostname, the socket interfaces, and the
versions (posted on the agent's own etcd lease, so they stay while the agent
lives, then compared with those of every node that posted before). Each
node compares what it can see, so the last node to start names every
mismatch. A fault here costs one log line: the job goes on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Any, Mapping, Sequence

from elastic_ft.preflight import network, versions
from elastic_ft.preflight.report import Result

log = logging.getLogger(__name__)

OPT_OUT_ENV = "ELASTIC_FT_DOCTOR_AT_START"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def startup_results(client: Any, run_prefix: str, max_nodes: int, etcd_hosts: Sequence[str],
                    environ: Mapping[str, str]) -> list[Result]:
    """The fast subset's results; [] for a single-node job."""
    if max_nodes <= 1:
        return []
    # etcd on loopback: every node is on this machine (a rehearsal), where loopback is the right address.
    remote = not all(_loopback(h) for h in etcd_hosts)
    results = [network.check_hostname(None, remote), *network.check_interfaces(environ, remote)]
    prefix = versions.versions_prefix(run_prefix)
    try:
        versions.post_versions(client, prefix, versions.node_name(), versions.local_versions())
        results.append(versions.versions_result(versions.read_versions(client, prefix)))
    except Exception as exc:  # etcd trouble shows in the rendezvous itself, with its own message
        results.append(Result("WARN", "versions", f"could not post or read the nodes' versions: {exc}"))
    return results


def report_at_startup(client: Any, run_prefix: str, max_nodes: int, etcd_hosts: Sequence[str],
                      environ: Mapping[str, str] = os.environ) -> list[Result]:
    """Log one line per fast check (FAIL and WARN as warnings); never raises. Off with ``ELASTIC_FT_DOCTOR_AT_START=0``."""
    if environ.get(OPT_OUT_ENV, "1") == "0":
        return []
    try:
        results = startup_results(client, run_prefix, max_nodes, etcd_hosts, environ)
    except Exception as exc:  # a diagnosis must never stop the job it diagnoses
        log.warning("elastic-ft doctor at start-up could not run: %s", exc)
        return []
    for r in results:
        level = logging.WARNING if r.status in ("FAIL", "WARN") else logging.INFO
        log.log(level, "elastic-ft doctor: %s", r.line())
    return results
