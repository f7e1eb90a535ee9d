"""The AWS Batch requests of an ``elastic_ft.train`` app: an array job of single-node containers.

AWS Batch does not run multi-node parallel jobs on Spot, so each node of an
elastic_ft job is one child of an array job (one plain container job when the
job has one node). The children find each other through the etcd3 rendezvous
under ``--run_id``, and each child's retry strategy (:mod:`.retry`) resubmits
a node that Spot took. Everything here is pure: the app and the run options
in, the requests (printable, for ``--dryrun``) or the problems out.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Tuple

import torchx
from torchx.schedulers import aws_batch_scheduler as stock
from torchx.specs import AppDef, Role, macros

from elastic_ft.aws_batch.retry import DEFAULT_ATTEMPTS, attempts_problem, retry_strategy
from elastic_ft.submission import app_metadata as meta_keys
from elastic_ft.submission.arguments import ComponentArgumentError

MAX_ARRAY_SIZE = 10_000  # AWS Batch: an array job has 2 to 10,000 children
MAX_NAME = 128  # job and job definition names: letters, digits, '-' and '_'
ARRAY_INDEX = "${AWS_BATCH_JOB_ARRAY_INDEX:-0}"  # unset in a plain (size 1) container job


_SECRET = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*:arn:\S+$")


class BatchArgumentError(ComponentArgumentError):
    """An app or run option that cannot work as an AWS Batch array job; one line per problem.

    A ComponentValidationException, so ``torchx run`` prints the message
    without a traceback and exits 1; a ValueError to Python callers.
    """


@dataclass(frozen=True)
class ArrayJobRequest:
    """What ``schedule`` sends: ``register_job_definition(**job_definition)``, then ``submit_job(**submit_job)``."""

    queue: str
    name: str
    """The unique job name, also the job definition's name."""
    job_definition: Dict[str, Any]
    """Keyword arguments of ``batch.register_job_definition``; type ``container``."""
    submit_job: Dict[str, Any]
    """Keyword arguments of ``batch.submit_job``; ``arrayProperties`` when more than one node."""
    images_to_push: Dict[str, Tuple[str, str]]


def is_elastic_ft(app: AppDef) -> bool:
    """Whether ``app`` is ``elastic_ft.train``'s (its metadata carries the marker)."""
    return app.metadata.get(meta_keys.MARKER) == "train"


def problems(app: AppDef, cfg: Mapping[str, Any]) -> List[str]:
    """Every reason ``app`` cannot run as an array job, one line each naming the argument to change."""
    meta = app.metadata
    found = []
    if not isinstance(cfg.get("queue"), str) or not cfg.get("queue"):
        found.append("-cfg queue=NAME: the AWS Batch job queue (of a Spot compute environment) is required")
    max_nodes = int(meta.get(meta_keys.MAX_NODES, "1"))
    if max_nodes > MAX_ARRAY_SIZE:
        found.append(
            f"--nnodes: a max of {max_nodes} nodes is over AWS Batch's {MAX_ARRAY_SIZE:,} children "
            f"of an array job; give MIN:MAX with MAX <= {MAX_ARRAY_SIZE}"
        )
    backend = meta.get(meta_keys.RDZV_BACKEND, "")
    rdzv_ok = False
    if backend != "etcd3":
        found.append(
            f"--rdzv_backend {backend}: on aws_batch the nodes are separate jobs with no rank-0 host for "
            "c10d to use; give --rdzv_backend etcd3 --rdzv_endpoint HOST:PORT of an etcd v3 server"
        )
    elif meta.get(meta_keys.RDZV_ENDPOINT) != "given":
        found.append("--rdzv_endpoint: give HOST:PORT of the etcd v3 server the nodes meet at")
    else:
        rdzv_ok = True
    scheme = meta.get(meta_keys.CHECKPOINT_SCHEME, "")
    if scheme != "s3":
        found.append(
            f"--checkpoint_uri: a {scheme}:// URI is local to one node; on aws_batch every node reads "
            "and writes the same checkpoints: give s3://BUCKET/PREFIX"
        )
    if not meta.get(meta_keys.RUN_ID):
        found.append(
            "--run_id: required on aws_batch, the rendezvous id and checkpoint directory that a retried "
            "or resubmitted node must find again (e.g. --run_id llama8b-sft-1)"
        )
    attempts = attempts_problem(cfg.get("attempts", DEFAULT_ATTEMPTS))
    if attempts:
        found.append(attempts)
    found += [
        f"-cfg secrets: {item!r} is not NAME:ARN (a variable name, then the Secrets Manager or SSM "
        "parameter ARN Batch reads its value from, e.g. ELASTIC_FT_ETCD_PASSWORD:arn:aws:secretsmanager:...)"
        for item in cfg.get("secrets") or []
        if not _SECRET.match(item)
    ]
    return found + _role_problems(app.roles, rdzv_ok=rdzv_ok)


def _role_problems(roles: List[Role], *, rdzv_ok: bool) -> List[str]:
    """Problems with the roles themselves: one role; no rank-0 host macro (when the rendezvous is not already refused)."""
    if len(roles) != 1:
        return [f"the app has {len(roles)} roles; an elastic_ft array job runs exactly one"]
    role = roles[0]
    if rdzv_ok and any(macros.rank0_env in text for text in [*role.args, *role.env.values()]):
        return ["--rdzv_endpoint: array children have no rank-0 host to name; give the etcd server's HOST:PORT"]
    return []


def check(app: AppDef, cfg: Mapping[str, Any]) -> None:
    """Raise :class:`BatchArgumentError` listing every problem of :func:`problems`, or nothing."""
    found = problems(app, cfg)
    if found:
        raise BatchArgumentError("\n".join(found))


def job_base_name(app: AppDef, share_id: Any = None) -> str:
    """The name before torchx's unique suffix: the app's name (and ``-SHARE``), in Batch's alphabet.

    Room is left for ``-`` and torchx's random suffix (at most 14 characters).
    """
    base = app.name + (f"-{share_id}" if share_id is not None else "")
    return re.sub(r"[^A-Za-z0-9_-]", "-", base)[: MAX_NAME - 16]


def build(
    app: AppDef, cfg: Mapping[str, Any], *, name: str, images_to_push: Dict[str, Tuple[str, str]]
) -> ArrayJobRequest:
    """The requests of ``app`` under job name ``name``, after :func:`check`.

    The macros resolve as for torchx's own scheduler, the replica id being the
    array index, which programs should rather read from the environment
    (AWS_BATCH_JOB_ARRAY_INDEX, AWS_BATCH_JOB_ATTEMPT): Batch does not expand
    environment values, only bash expands the command line.
    """
    check(app, cfg)
    # rank0_env: array children have no main node; check() refused any use of the macro.
    role = macros.Values(img_root="", app_id=name, replica_id=ARRAY_INDEX, rank0_env="").apply(app.roles[0])
    role.env[stock.ENV_TORCHX_ROLE_IDX] = "0"
    role.env[stock.ENV_TORCHX_ROLE_NAME] = role.name
    size = role.num_replicas
    retry = retry_strategy(cfg.get("attempts", DEFAULT_ATTEMPTS))
    tags = _tags(app, cfg)
    job_definition = {
        "jobDefinitionName": name,
        "type": "container",
        "containerProperties": _container(role, cfg),
        # Also on the definition, so a node resubmitted by hand from it keeps the rules.
        "retryStrategy": retry,
        "propagateTags": True,
        "tags": tags,
    }
    submit = {
        "jobName": name,
        "jobQueue": cfg["queue"],
        "jobDefinition": name,
        **({"arrayProperties": {"size": size}} if size > 1 else {}),
        "retryStrategy": retry,
        "propagateTags": True,
        "tags": dict(tags),
    }
    share_id = cfg.get("share_id")
    if share_id is not None:
        submit["shareIdentifier"] = share_id
        submit["schedulingPriorityOverride"] = cfg.get("priority", 0)
    return ArrayJobRequest(
        queue=cfg["queue"], name=name, job_definition=job_definition, submit_job=submit,
        images_to_push=images_to_push,
    )


def _container(role: Role, cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The ``containerProperties`` of one node: command, image, environment, resources, mounts.

    torchx's private ``_role_to_node_properties`` builds the same container
    dict for a multi-node group (mounts, devices, /dev/shm, awslogs, roles); it
    is reused so that mounts and resources read exactly as for torchx's jobs.
    Its ``instanceType`` applies to multi-node groups only and is dropped.
    Batch runs EC2 container jobs on the host's network, so no ports are mapped.
    """
    one = dataclasses.replace(role, num_replicas=1, mounts=list(role.mounts))  # it extends mounts
    container = stock._role_to_node_properties(
        one,
        start_idx=0,
        privileged=bool(cfg.get("privileged", False)),
        job_role_arn=cfg.get("job_role_arn"),
        execution_role_arn=cfg.get("execution_role_arn"),
    )["container"]
    container.pop("instanceType", None)
    secrets = [item.split(":", 1) for item in cfg.get("secrets") or []]
    if secrets:
        # Batch puts each value in the named variable, read with the execution role; the
        # value is never in the job definition (the etcd password: --rdzv_conf password_env=NAME).
        container["secrets"] = [{"name": name, "valueFrom": arn} for name, arn in secrets]
    return container


def _tags(app: AppDef, cfg: Mapping[str, Any]) -> Dict[str, str]:
    """torchx's tags (its version tag is what ``torchx list`` looks for) and ours.

    Only the marker and the run id of the app's metadata: the other facts are
    for validation, not for finding jobs.
    """
    return {
        stock.TAG_TORCHX_VER: torchx.__version__,
        stock.TAG_TORCHX_APPNAME: app.name,
        stock.TAG_TORCHX_USER: str(cfg.get("user") or ""),
        meta_keys.MARKER: app.metadata[meta_keys.MARKER],
        meta_keys.RUN_ID: app.metadata.get(meta_keys.RUN_ID, ""),
    }


def describe_request(request: ArrayJobRequest) -> str:
    """The exact calls ``schedule`` makes, as JSON (the ``--dryrun`` output)."""
    calls = {
        "register_job_definition": request.job_definition,
        "submit_job": request.submit_job,
    }
    if request.images_to_push:
        calls["images_to_push"] = asdict(request)["images_to_push"]
    return json.dumps(calls, indent=2, default=str)
