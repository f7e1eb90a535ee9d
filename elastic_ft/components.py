"""torchx components: ``torchx run -s local_cwd elastic_ft.train [...]``.

The component builds an AppDef whose role runs ``torchrun`` on every node;
torchrun starts one ``elastic_ft.worker`` per process and restarts them on
failure, and the rendezvous (c10d, or etcd3 for spot fleets) lets nodes join
and leave between the min and max node counts.

Exit status of a node (its torchrun), for a scheduler's retry rules:

- 0: the job completed.
- 75 (``EX_TEMPFAIL``, :data:`elastic_ft.handoff.leave_marker.RECLAIM_EXIT_CODE`): with
  ``rdzv_backend=etcd3``, the node left on a spot notice (IMDS terminate, stop
  or hibernate, or SIGTERM to torchrun, as a container stop sends) after the
  job committed its state; the other nodes go on without it. Resubmit the
  node: it joins the running job again (or, if all left, resumes it). On AWS
  Batch, single-node (array) jobs on Spot with a retry strategy such as
  ``{"attempts": 10, "evaluateOnExit": [{"onExitCode": "75", "action": "RETRY"},
  {"onStatusReason": "Host EC2*", "action": "RETRY"}, {"onReason": "*",
  "action": "EXIT"}]}`` resubmit a node that left on a notice (75) or whose
  host was reclaimed before it could (the status reason then starts with
  "Host EC2"), and fail on anything else. ``torchx run -s aws_batch
  elastic_ft.train`` submits exactly that (:mod:`elastic_ft.aws_batch`: an array
  job of single-node containers, rules in :mod:`elastic_ft.aws_batch.retry`); for
  other apps torchx's own ``aws_batch`` scheduler still retries every nonzero
  exit up to ``max_restarts`` times.
- 1: the workers failed more than ``max_restarts`` times, or the agent failed.
- 2 is a worker's status for a user error (bad spec, URI, data); torchrun
  reports it as a failure (1).

Each node that stays restarts its workers once per leave, at the same step
boundary, as a membership change: with the etcd3 rendezvous a leave does not
count against ``max_restarts`` (with c10d it does).
"""


import dataclasses
import functools
import os
import re
import shlex
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torchx
import torchx.specs as specs
from torchx.specs import macros
from torchx.specs.finder import ComponentValidationException

from elastic_ft.config.names import check_name

_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")


class ComponentArgumentError(ComponentValidationException, ValueError):
    """A component argument that cannot work; the message names it.

    ``torchx run`` prints a ComponentValidationException as its message under
    one header line ("Failed to run component ... got errors:") and exits 1;
    any other exception from a component gets a full traceback. To Python
    callers it is a ValueError.
    """


def _argument_errors(component):
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


def parse_nnodes(nnodes: str) -> "tuple[int, int]":
    """``"N"`` or ``"MIN:MAX"`` as (min, max); ValueError naming the argument otherwise."""
    m = _NNODES.match(nnodes.strip())
    if not m:
        raise ValueError(f"--nnodes {nnodes!r} must be N or MIN:MAX, e.g. 2 or 2:8")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1 or hi < lo:
        raise ValueError(f"--nnodes {nnodes!r}: need 1 <= MIN <= MAX")
    return lo, hi


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


@_argument_errors
def train(
    *overrides: str,
    nnodes: str = "1",
    nproc_per_node: int = 0,
    spec: str = "specs/tiny-lora.yaml",
    run_id: Optional[str] = None,
    checkpoint_uri: str = "file://./runs",
    rdzv_backend: str = "c10d",
    rdzv_endpoint: Optional[str] = None,
    rdzv_conf: Optional[str] = None,
    max_restarts: int = 3,
    replicas: int = 0,
    image: str = torchx.IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    efa: int = -1,
    memMB: int = 8192,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    log_dir: Optional[str] = None,
) -> specs.AppDef:
    """Fine-tune a Hugging Face causal LM (LoRA or full) elastically with elastic_ft.

    Args:
        overrides: job spec overrides as field.path=value, e.g. optimizer.lr=3e-4 steps=200
        nnodes: number of nodes, N or MIN:MAX (elastic: the job goes on while at least MIN remain)
        nproc_per_node: training processes per node (one per GPU; on CPU, a few); 0 (default): the node's GPU count (--gpu, or the named host type's), else 2
        spec: job spec YAML (model, data, LoRA, optimizer, batch, steps, checkpoint)
        run_id: stable id of the job across restarts and resubmissions (letters, digits, '.', '_', '-'; at most 128 characters); checkpoints live under checkpoint_uri/run_id (default: the spec's name)
        checkpoint_uri: where runs' checkpoints live: file://./runs, file:///abs/dir or s3://bucket/prefix
        rdzv_backend: rendezvous backend: c10d (one node hosts it), or etcd3 (no node holds the job's state; for spot)
        rdzv_endpoint: rendezvous endpoint HOST:PORT (etcd3: an etcd v3 server); default for c10d: the first node
        rdzv_conf: extra rendezvous options key=value,... (e.g. join_timeout=600, and etcd3's TLS and auth options; the password only as password_env=VAR)
        max_restarts: times torchrun restarts failed workers before giving up (a spot leave on etcd3 costs none)
        replicas: node agents this submission starts (0: the max of nnodes); several submissions with the same run_id and etcd3 make heterogeneous nodes
        image: container image (local_cwd: ignored, the current directory is used)
        cpu: CPUs per node
        gpu: GPUs per node (each process then trains on one, over NCCL; NCCL_*, TORCH_NCCL_*, FI_* and OFI_NCCL_* variables of the submitting environment, e.g. EFA's FI_PROVIDER=efa, are passed to the nodes)
        efa: EFA network interfaces per node, mounted into the container (/dev/infiniband/uverbsN; aws_batch) so NCCL's collectives between nodes take EFA, with FI_PROVIDER=efa unless set; -1 (default): the named host type's count (--h, e.g. aws_p4d.24xlarge: 4, aws_p5.48xlarge: 32), else none; 0: none
        memMB: memory per node in MB
        h: a named host type (scheduler specific), instead of cpu/gpu/memMB
        env: extra environment variables, e.g. AWS_REGION=us-east-1,ELASTIC_FT_LOG_LEVEL=DEBUG
        log_dir: directory of events.jsonl (default: the spec's logging.dir, else the run's directory's logs/ for a file:// checkpoint_uri, ~/.cache/elastic_ft/runs/RUN_ID/logs for s3://)
    """
    resource = with_efa(specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h), efa)
    nproc_per_node = default_nproc(nproc_per_node, resource.gpu)
    lo, hi = _check_arguments(
        nnodes=nnodes, nproc_per_node=nproc_per_node, gpus=resource.gpu, run_id=run_id, rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, max_restarts=max_restarts, replicas=replicas,
    )
    cmd = _torchrun_args(
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint or _default_endpoint(hi),
        rdzv_id=run_id or f"{macros.app_id}",
        rdzv_conf=rdzv_conf,
        nnodes=f"{lo}:{hi}" if lo != hi else str(lo),
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
    )
    cmd += _worker_args(
        overrides, spec=spec, checkpoint_uri=checkpoint_uri, run_id=run_id, log_dir=log_dir
    )
    return specs.AppDef(
        name=f"elastic-ft-{run_id}" if run_id else "elastic-ft",
        roles=[
            specs.Role(
                name="trainer",
                image=image,
                entrypoint="bash",
                args=["-c", _bash_line(cmd)],
                num_replicas=replicas or hi,
                min_replicas=lo,
                resource=resource,
                env=_job_env(env, os.environ, nproc_per_node=nproc_per_node, efa=efa_count(resource)),
                port_map={"c10d": 29500},
                max_retries=max_restarts,
            )
        ],
        metadata=_app_metadata(lo, hi, rdzv_backend, rdzv_endpoint, checkpoint_uri, run_id),
    )


MARKER = "elastic_ft.component"
"""The AppDef metadata key that marks an app as :func:`train`'s (value ``"train"``).

The other ``elastic_ft.*`` keys are the facts a scheduler checks without
parsing the bash line (``elastic_ft.aws_batch`` does). torchx's aws_batch and
aws_sagemaker schedulers copy metadata into AWS tags, so every value is
tag-safe: at most 256 characters of letters, digits, spaces and ``_.:/=+-@``.
"""

_TAG_SAFE = re.compile(r"^[A-Za-z0-9 _.:/=+@-]{0,256}$")


def _app_metadata(
    lo: int,
    hi: int,
    rdzv_backend: str,
    rdzv_endpoint: Optional[str],
    checkpoint_uri: str,
    run_id: Optional[str],
) -> Dict[str, str]:
    """The AppDef's metadata: the marker and the structured facts, each value tag-safe.

    The checkpoint URI itself may hold any character S3 keys allow, so only its
    scheme is kept; a backend name that is not tag-safe is kept as ``"other"``.
    """
    scheme = checkpoint_uri.partition("://")[0] if "://" in checkpoint_uri else ""
    return {
        MARKER: "train",
        "elastic_ft.min_nodes": str(lo),
        "elastic_ft.max_nodes": str(hi),
        "elastic_ft.rdzv_backend": rdzv_backend if _TAG_SAFE.match(rdzv_backend) else "other",
        "elastic_ft.rdzv_endpoint": "given" if rdzv_endpoint else "",
        "elastic_ft.checkpoint_scheme": scheme if scheme.isalnum() else "other",
        # check_name keeps run ids to letters, digits, '.', '_' and '-', at most 128.
        "elastic_ft.run_id": run_id or "",
    }


def _check_arguments(
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
) -> Tuple[int, int]:
    """The (min, max) node counts of ``nnodes``.

    Raises:
        ValueError: naming the first bad argument of :func:`train`.
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
    if rdzv_conf:
        check_rdzv_conf(rdzv_conf)
    if rdzv_backend == "etcd3" and not rdzv_endpoint:
        raise ValueError("--rdzv_backend etcd3 needs --rdzv_endpoint HOST:PORT of an etcd v3 server")
    return lo, hi


def _default_endpoint(max_nodes: int) -> str:
    """The c10d endpoint when none is given.

    One node: any free port. Several: the scheduler's rank-0 host, as torchx's
    dist.ddp does (a ``$`` variable, which :func:`_torchrun_args` leaves for bash to expand).
    """
    return "localhost:0" if max_nodes == 1 else f"${{{macros.rank0_env}:=localhost}}:29500"


def _torchrun_args(
    *,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_id: str,
    rdzv_conf: Optional[str],
    nnodes: str,
    nproc_per_node: int,
    max_restarts: int,
) -> List[str]:
    """``torchrun`` and its own options, up to (not including) the module it runs."""
    cmd = [
        "torchrun",
        "--rdzv_backend", rdzv_backend,
        "--rdzv_endpoint", _Raw(rdzv_endpoint) if "$" in rdzv_endpoint else rdzv_endpoint,
        "--rdzv_id", rdzv_id,
        "--nnodes", nnodes,
        "--nproc_per_node", str(nproc_per_node),
        "--max_restarts", str(max_restarts),
    ]
    if rdzv_conf:
        cmd += ["--rdzv_conf", rdzv_conf]
    return cmd


def _worker_args(
    overrides: Sequence[str],
    *,
    spec: str,
    checkpoint_uri: str,
    run_id: Optional[str],
    log_dir: Optional[str],
) -> List[str]:
    """``-m elastic_ft.worker`` and its arguments, the job spec overrides last."""
    cmd = ["-m", "elastic_ft.worker", "--spec", spec, "--checkpoint_uri", checkpoint_uri]
    if run_id:
        cmd += ["--run_id", run_id]
    if log_dir:
        cmd += ["--log_dir", log_dir]
    return cmd + list(overrides)


EFA_DEVICE = "vpc.amazonaws.com/efa"
"""torchx's name of an EFA interface among a resource's ``devices`` (``named_resources_aws.EFA_DEVICE``):
its aws_batch scheduler mounts N of them as ``/dev/infiniband/uverbs0..N-1`` in the job definition."""


def with_efa(resource: specs.Resource, efa: int) -> specs.Resource:
    """``resource`` with ``efa`` EFA interfaces (-1: as it comes, i.e. the named host type's; 0: none).

    Raises:
        ValueError: naming ``--efa`` when it is below -1.
    """
    if efa < -1:
        raise ValueError(f"--efa must be -1 (the host type's), 0 (none) or a count of interfaces, got {efa}")
    if efa == -1:
        return resource
    devices = {k: v for k, v in resource.devices.items() if k != EFA_DEVICE}
    if efa:
        devices[EFA_DEVICE] = efa
    return dataclasses.replace(resource, devices=devices)


def efa_count(resource: specs.Resource) -> int:
    return resource.devices.get(EFA_DEVICE, 0)


def default_nproc(nproc_per_node: int, gpus: int) -> int:
    """Processes per node: as given, else (0) one per GPU on a GPU node, else 2 (a CPU node's default).

    0 rather than None: torchx passes an ``Optional[int]`` argument through as a string."""
    if nproc_per_node != 0:
        return nproc_per_node
    return gpus if gpus > 0 else 2


PASSTHROUGH_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_", "OFI_NCCL_")
"""Variables of the submitting environment copied to every node: NCCL's and torch's NCCL settings, and
libfabric's (``FI_PROVIDER=efa``, ``FI_EFA_USE_DEVICE_RDMA``) and aws-ofi-nccl's, which EFA needs."""


def passthrough_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """The NCCL and EFA (libfabric) settings of ``environ`` to pass on to the nodes."""
    return {k: v for k, v in environ.items() if k.startswith(PASSTHROUGH_PREFIXES)}


def _job_env(env: Optional[Dict[str, str]], environ: Mapping[str, str], *, nproc_per_node: int = 1,
             efa: int = 0) -> Dict[str, str]:
    """The environment of every node: ours, the NCCL/EFA settings of ``environ``, then the user's ``env``."""
    job_env = {
        # torch 2.13: a node joining a running job hangs waiting for MASTER_ADDR
        # unless the agent's store is not shared with the rendezvous.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        "LOGLEVEL": "WARNING",
    }
    if nproc_per_node > 1:
        # What torchrun sets itself for more than one process per node, set here so it
        # does not print its four-line banner about it on every start.
        job_env["OMP_NUM_THREADS"] = "1"
    if efa:
        # libfabric then fails loudly where the devices are missing, instead of NCCL falling back to TCP sockets.
        job_env["FI_PROVIDER"] = "efa"
    job_env.update(passthrough_env(environ))
    job_env.update(env or {})
    return job_env


def _bash_line(cmd: Sequence[str]) -> str:
    """``cmd`` as one ``bash -c`` line: each argument quoted, except :class:`_Raw` ones."""
    return " ".join(a if isinstance(a, _Raw) else shlex.quote(a) for a in cmd)


class _Raw(str):
    """An argument left unquoted so bash expands it (the rank-0 host variable)."""
