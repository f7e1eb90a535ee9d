"""The rendezvous as a node sees it: etcd answers and speaks v3; all nodes run the same versions.

The connection is the agent's own (the ``--rdzv_conf`` options parsed as
torchrun's are, TLS and credentials included) with short timeouts: a doctor
that retries for the rendezvous's 30 s looks hung exactly when etcd is down.

Versions: each node posts ``{torch, cuda, nccl, elastic_ft, python}`` under
``<run prefix>doctor/versions/<host>-<pid>``, on a lease of a few minutes so
that the posts of nodes long gone do not linger, and reads everyone's. A node
with another torch or NCCL build joins the rendezvous fine and then hangs or
crashes in its first collective, far from the cause.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
from typing import Any, Mapping

from elastic_ft.doctor.report import Result

FIELDS = ("torch", "cuda", "nccl", "elastic_ft", "python")
VERSIONS_TTL_S = 300
_FIX_DOWN = ("start etcd (etcd --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://HOST:2379), "
             "or correct --rdzv_endpoint; check the firewall between this node and etcd")


def parse_conf(text: str | None) -> dict[str, str]:
    """``k=v,k=v`` as torchrun's ``--rdzv-conf`` takes it; ValueError naming an item without ``=``."""
    out = {}
    for item in filter(None, (i.strip() for i in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv_conf item {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def open_client(endpoint: str, conf: Mapping[str, str], environ: Mapping[str, str] | None = None) -> tuple[Any, Any]:
    """``(options, client)`` for the run's etcd with short timeouts; ValueError listing bad options."""
    from elastic_ft.rendezvous.etcd import EtcdClient
    from elastic_ft.rendezvous.options import parse_options

    options = parse_options(endpoint, conf, environ)
    # Short: one slow answer is a finding, not something to wait out. The lease
    # is the versions' lifetime, not the rendezvous's.
    settings = dataclasses.replace(options.connection, request_timeout=3.0, retry_timeout=2.0, lease_ttl=VERSIONS_TTL_S)
    return options, EtcdClient(settings, name="doctor")


def etcd_result(endpoint: str, version: str | None, problem: str | None) -> Result:
    """Decide from etcd's Status answer (its version) or the error that stood in for it."""
    if problem is not None:
        return Result("FAIL", "rendezvous", f"etcd at {endpoint} did not answer: {problem}", _FIX_DOWN)
    if not version or not version.startswith("3."):
        return Result("FAIL", "rendezvous", f"{endpoint} answered as etcd version {version!r}, not 3.x",
                      "the etcd3 rendezvous needs etcd 3.4 or later")
    return Result("PASS", "rendezvous", f"etcd {version} at {endpoint} answers the v3 API")


def check_etcd(client: Any) -> Result:
    from elastic_ft.rendezvous.etcd import EtcdClientError, EtcdUnavailableError

    endpoint = client.settings.endpoints_text
    try:
        return etcd_result(endpoint, client.server_version(), None)
    except EtcdUnavailableError as exc:
        return etcd_result(endpoint, None, str(exc).splitlines()[0])
    except EtcdClientError as exc:  # bad credentials or TLS: etcd is there but refuses us
        return Result("FAIL", "rendezvous", f"etcd at {endpoint} refused this client: {exc}",
                      "check user/password_env and the TLS files in --rdzv_conf")


def local_versions() -> dict[str, str]:
    """This node's versions of what must match across nodes (imports torch: the agent has it already)."""
    import torch

    import elastic_ft

    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    except Exception:  # a CPU build has no NCCL; some builds raise instead of saying so
        nccl = "none"
    return {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "nccl": nccl,
            "elastic_ft": elastic_ft.__version__, "python": platform.python_version()}


def node_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def versions_prefix(run_prefix: str) -> str:
    """Where the run's nodes post versions: beside the rendezvous state, under its run prefix."""
    return f"{run_prefix}doctor/versions/"


def post_versions(client: Any, prefix: str, node: str, versions: Mapping[str, str]) -> None:
    """Write this node's versions on the client's lease (``VERSIONS_TTL_S``)."""
    client.put_many([(prefix + node, json.dumps(dict(versions), sort_keys=True).encode())])


def read_versions(client: Any, prefix: str) -> dict[str, dict[str, str]]:
    """Every posted node's versions; unreadable posts are skipped (another tool's key)."""
    keys = client.keys_under(prefix)
    out = {}
    for key, kv in zip(keys, client.get_many(keys)):
        try:
            out[key[len(prefix):]] = json.loads(kv.value) if kv is not None else None
        except ValueError:
            continue
    return {node: v for node, v in out.items() if isinstance(v, dict)}


def versions_result(posted: Mapping[str, Mapping[str, str]]) -> Result:
    """FAIL naming each field whose value differs between nodes, with the nodes on each value."""
    name = "versions"
    if not posted:
        return Result("SKIP", name, "no node has posted its versions for this run (run doctor --post on each node)")
    diffs = []
    for field in FIELDS:
        by_value: dict[str, list[str]] = {}
        for node in sorted(posted):
            by_value.setdefault(str(posted[node].get(field, "missing")), []).append(node)
        if len(by_value) > 1:
            diffs.append(f"{field}: " + "; ".join(f"{v} on {', '.join(nodes)}" for v, nodes in by_value.items()))
    if diffs:
        return Result("FAIL", name, f"nodes differ: {' | '.join(diffs)}",
                      "run one image (same torch, CUDA, NCCL, elastic_ft and python) on every node")
    one = posted[sorted(posted)[0]]
    same = ", ".join(f"{f} {one.get(f)}" for f in FIELDS)
    return Result("PASS", name, f"{len(posted)} node(s) agree: {same}")
