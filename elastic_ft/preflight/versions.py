"""Every node of a run posts its versions in etcd and reads the others': a mismatch named before it hangs.

Each node posts ``{torch, cuda, nccl, elastic_ft, python}`` under
``<run prefix>doctor/versions/<host>-<pid>``, on a lease of a few minutes
(:data:`VERSIONS_TTL_S`) so that the posts of nodes long gone do not linger,
and reads everyone's. A node with another torch or NCCL build joins the
rendezvous fine and then hangs or crashes in its first collective, far from
the cause. The etcd client is passed in (the agent's own, or the doctor's).
"""

from __future__ import annotations

import json
import os
import platform
import socket
from typing import Any, Mapping

from elastic_ft.preflight.report import Result

FIELDS = ("torch", "cuda", "nccl", "elastic_ft", "python")
VERSIONS_TTL_S = 300


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
