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
- 69 / 78 (etcd3): etcd unreachable past ``retry_timeout`` / credentials or a
  ``rdzv_conf`` option refused, at start (:mod:`elastic_ft.rendezvous.entry`); not retried.
- 2 is a worker's status for a user error (bad spec, URI, data); torchrun
  reports it as a failure (1).

Each node that stays restarts its workers once per leave, at the same step
boundary, as a membership change: with the etcd3 rendezvous a leave does not
count against ``max_restarts`` (with c10d it does).
"""


import os
from typing import Dict, List, Optional, Sequence

import torchx
import torchx.specs as specs
from torchx.specs import macros

from elastic_ft.checkpoint.store import check_uri
from elastic_ft.submission.app_metadata import app_metadata
from elastic_ft.submission.arguments import argument_errors, check_arguments
from elastic_ft.submission.bash_line import RANK0_ENDPOINT, bash_line
from elastic_ft.submission.host_types import node_resource
from elastic_ft.submission.batch_fit import check_batch_fits
from elastic_ft.submission.node_resources import default_nproc, efa_count, job_env, with_efa


@argument_errors
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
        rdzv_endpoint: rendezvous endpoint HOST:PORT (etcd3: HOST:PORT[,HOST:PORT...] of etcd v3 members); default for c10d: the first node
        rdzv_conf: extra rendezvous options key=value,... (e.g. join_timeout=600, and etcd3's TLS and auth options; the password only as password_env=VAR)
        max_restarts: times torchrun restarts failed workers before giving up (a spot leave on etcd3 costs none)
        replicas: node agents this submission starts (0: the max of nnodes); several submissions with the same run_id and etcd3 make heterogeneous nodes
        image: container image (local_cwd: ignored, the current directory is used)
        cpu: CPUs per node
        gpu: GPUs per node (each process then trains on one, over NCCL; NCCL_*, TORCH_NCCL_*, FI_* and OFI_NCCL_* variables of the submitting environment, e.g. EFA's FI_PROVIDER=efa, are passed to the nodes)
        efa: EFA network interfaces per node, mounted into the container (/dev/infiniband/uverbsN; aws_batch) so NCCL's collectives between nodes take EFA, with FI_PROVIDER=efa unless set; -1 (default): the named host type's count (--h, e.g. aws_p4d.24xlarge: 4, aws_p5.48xlarge: 32), else none; 0: none
        memMB: memory per node in MB
        h: a named host type (scheduler specific), instead of cpu/gpu/memMB; its GPUs are then the default of gpu and nproc_per_node: torchx's (aws_p4d.24xlarge, aws_p5.48xlarge, aws_g5.xlarge, ...) and aws_g6.* / aws_g6e.* (L4 / L40S), e.g. aws_g6.xlarge: 1 GPU of 24 GB, for specs/llama-3.1-8b-qlora-spot.yaml
        env: extra environment variables, e.g. AWS_REGION=us-east-1,ELASTIC_FT_LOG_LEVEL=DEBUG (shell variable names; not those bash acts on at start, such as BASH_ENV)
        log_dir: directory of events.jsonl (default: the spec's logging.dir, else the run's directory's logs/ for a file:// checkpoint_uri, ~/.cache/elastic_ft/runs/RUN_ID/logs for s3://)
    """
    resource = with_efa(node_resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h), efa)
    nproc_per_node = default_nproc(nproc_per_node, resource.gpu)
    lo, hi = check_arguments(
        nnodes=nnodes, nproc_per_node=nproc_per_node, gpus=resource.gpu, run_id=run_id, rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, max_restarts=max_restarts, replicas=replicas, env=env,
    )
    check_batch_fits(spec, overrides, max_nodes=hi, nnodes=nnodes, nproc_per_node=nproc_per_node)
    check_uri(checkpoint_uri)  # as every worker would at its start, before anything is submitted
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
                args=["-c", bash_line(cmd)],
                num_replicas=replicas or hi,
                min_replicas=lo,
                resource=resource,
                env=job_env(env, os.environ, nproc_per_node=nproc_per_node, efa=efa_count(resource)),
                port_map={"c10d": 29500},
                max_retries=max_restarts,
            )
        ],
        metadata=app_metadata(lo, hi, rdzv_backend, rdzv_endpoint, checkpoint_uri, run_id),
    )


def _default_endpoint(max_nodes: int) -> str:
    """The c10d endpoint when none is given.

    One node: any free port. Several: the scheduler's rank-0 host, as torchx's
    dist.ddp does (a ``$`` variable, the one argument :func:`bash_line` leaves for bash to expand).
    """
    return "localhost:0" if max_nodes == 1 else RANK0_ENDPOINT


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
        "--rdzv_endpoint", rdzv_endpoint,
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
