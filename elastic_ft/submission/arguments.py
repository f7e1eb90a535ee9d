"""The torchx component's argument checks: each bad argument is one line naming its flag, before anything is planned.

torchx prints a :class:`ComponentArgumentError` from a component as one line
under its own header ("Failed to run component `elastic_ft.train` got
errors:") and exits 1; any other exception gets a full traceback. Every value
a user gives is shown with ``repr`` (so a newline stays on the one line) and
cut when long.
"""

from __future__ import annotations

import functools
import re
from typing import Mapping, Optional, Tuple

from torchx.specs.finder import ComponentValidationException

from elastic_ft.config.names import check_name
from elastic_ft.submission.bash_line import BASH_START_VARIABLES, ENV_NAME

_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")

# A host name (RFC 1123 labels; '_' too, as container networks use it), an IPv4 address, or [IPv6].
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_PORT = re.compile(rf"((?:{_LABEL})(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]):([0-9]{{1,5}})")
MAX_HOST = 253
MAX_ENDPOINTS = 16
"""etcd clusters have 3, 5 or 7 members; 16 leaves room for a list that names some twice."""


class ComponentArgumentError(ComponentValidationException, ValueError):
    """A component argument that cannot work; the message names it.

    ``torchx run`` prints a ComponentValidationException as its message under
    one header line ("Failed to run component ... got errors:") and exits 1;
    any other exception from a component gets a full traceback. To Python
    callers it is a ValueError.
    """


def argument_errors(component):
    """Raise the ValueErrors of ``component`` as :class:`ComponentArgumentError`, so torchx shows no traceback.

    torchx reads a component's signature and docstring through ``functools.wraps``
    and lints its source, which the decorator leaves as it is.
    """

    @functools.wraps(component)
    def checked(*args, **kwargs):
        try:
            return component(*args, **kwargs)
        except ComponentArgumentError:
            raise
        except ValueError as exc:
            raise ComponentArgumentError(str(exc)) from exc

    return checked


def shown(text: str) -> str:
    """``text`` for an error line: its repr (a newline stays on the line), cut when long."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


def parse_nnodes(nnodes: str) -> "tuple[int, int]":
    """``"N"`` or ``"MIN:MAX"`` as (min, max); ValueError naming the argument otherwise."""
    m = _NNODES.match(nnodes.strip())
    if not m:
        raise ValueError(f"--nnodes {shown(nnodes)} must be N or MIN:MAX, e.g. 2 or 2:8")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1 or hi < lo:
        raise ValueError(f"--nnodes {shown(nnodes)}: need 1 <= MIN <= MAX")
    return lo, hi


def check_rdzv_endpoint(endpoint: str, backend: str) -> None:
    """Refuse anything but ``HOST:PORT[,HOST:PORT...]`` (c10d: exactly one; port 0 there: any free port).

    The endpoint reaches torchrun's command line on every node: only host
    names and addresses get there, no text a shell or torchrun would read as
    anything else.
    """
    items = endpoint.split(",")
    form = "HOST:PORT" if backend == "c10d" else "HOST:PORT[,HOST:PORT...]"
    if len(items) > (1 if backend == "c10d" else MAX_ENDPOINTS):
        raise ValueError(f"--rdzv_endpoint {shown(endpoint)}: {backend} takes at most "
                         f"{1 if backend == 'c10d' else MAX_ENDPOINTS} endpoint(s); give {form}")
    for item in items:
        m = _HOST_PORT.fullmatch(item)
        if not m or len(m.group(1)) > MAX_HOST:
            raise ValueError(
                f"--rdzv_endpoint {shown(endpoint)}: {shown(item)} is not HOST:PORT (a host name, an IPv4 "
                f"address or an [IPv6] address, then a port); give {form}, e.g. 10.0.0.5:2379"
            )
        port = int(m.group(2))
        if not (1 <= port <= 65535 or (port == 0 and backend == "c10d")):
            raise ValueError(f"--rdzv_endpoint {shown(endpoint)}: port {port} of {shown(item)} must be "
                             "between 1 and 65535")


def check_rdzv_conf(rdzv_conf: str) -> None:
    """Refuse secrets in ``--rdzv_conf``: it is part of the torchrun command line.

    torchrun splits it on ``,`` and ``=`` (keys stripped), as done here. A
    ``password=`` item would be readable by every user of the node (``ps``) and
    stored in the job definition; ``password_env=VAR`` names an environment
    variable that holds it on each node instead.
    """
    for item in rdzv_conf.split(","):
        key = item.partition("=")[0].strip()
        if key == "password":
            raise ValueError(
                "--rdzv_conf: password= would show the etcd password in the process list and "
                "the job definition; give password_env=VAR instead, the name of an environment "
                "variable that holds it on each node (e.g. from the scheduler's secrets)"
            )


def check_env(env: Mapping[str, str]) -> None:
    """Refuse ``--env`` names that are no variable names, or that bash acts on before it runs torchrun.

    Values are never parsed by a shell (they reach the process environment as
    they are), so they may hold anything.
    """
    for name in env:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"--env: {shown(name)} is not a variable name (letters, digits and '_', not "
                             "starting with a digit); bash reads some such names as functions")
        if name in BASH_START_VARIABLES:
            raise ValueError(f"--env: {name} would make bash run code before torchrun on every node; "
                             "leave it out (set the image up instead)")
        if name == "ELASTIC_FT_RDZV_KEY":  # state_codec.KEY_ENV (not imported: it loads torch)
            raise ValueError("--env: ELASTIC_FT_RDZV_KEY would put the rendezvous key on the command line and in the "
                             "job definition; set it in the submitting environment (local_cwd passes it on) or as a "
                             "scheduler secret (aws_batch: -cfg secrets=ELASTIC_FT_RDZV_KEY:ARN)")


def check_arguments(
    *,
    nnodes: str,
    nproc_per_node: int,
    gpus: int,
    run_id: Optional[str],
    rdzv_backend: str,
    rdzv_endpoint: Optional[str],
    rdzv_conf: Optional[str],
    max_restarts: int,
    replicas: int,
    env: Optional[Mapping[str, str]],
) -> Tuple[int, int]:
    """The (min, max) node counts of ``nnodes``.

    Raises:
        ValueError: naming the first bad argument of :func:`elastic_ft.components.train`.
    """
    lo, hi = parse_nnodes(nnodes)
    if run_id is not None:
        # One path component under checkpoint_uri, in torchx's log path and etcd's keys:
        # '../x' escaped all three.
        check_name(run_id, "--run_id")
    if nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node must be at least 1, got {nproc_per_node}")
    if gpus < 0:
        raise ValueError(f"--gpu must be 0 or more, got {gpus}")
    if gpus and nproc_per_node > gpus:
        # Each process takes the GPU of its LOCAL_RANK: one past the last would fail at start-up on every node.
        raise ValueError(f"--nproc_per_node {nproc_per_node} is more than the node's {gpus} GPU(s): one process "
                         f"per GPU; give at most {gpus}, or leave it out")
    if max_restarts < 0:
        raise ValueError(f"--max_restarts must be >= 0, got {max_restarts}")
    if replicas and not 1 <= replicas <= hi:
        raise ValueError(f"--replicas {replicas} must be between 1 and the max of --nnodes ({hi})")
    if rdzv_endpoint is not None:
        check_rdzv_endpoint(rdzv_endpoint, rdzv_backend)
    if rdzv_conf:
        check_rdzv_conf(rdzv_conf)
    if rdzv_backend == "etcd3" and not rdzv_endpoint:
        raise ValueError("--rdzv_backend etcd3 needs --rdzv_endpoint HOST:PORT of an etcd v3 server")
    check_env(env or {})
    return lo, hi
