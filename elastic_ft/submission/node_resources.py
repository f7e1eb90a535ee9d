"""A node's resources and environment: GPUs and processes, EFA interfaces, the NCCL/EFA settings passed on.

A named host type (``-h aws_p4d.24xlarge``) brings its GPUs and EFA
interfaces through torchx's named resources; ``--gpu``/``--efa`` state them
instead. The helpers here turn those into the role's resource, its process
count and the environment every node gets.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional

import torchx.specs as specs
from torchx.specs import macros

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


def job_env(env: Optional[Dict[str, str]], environ: Mapping[str, str], *, nproc_per_node: int = 1,
            efa: int = 0) -> Dict[str, str]:
    """The environment of every node: ours, the NCCL/EFA settings of ``environ``, then the user's ``env``."""
    out = {
        # torch 2.13: a node joining a running job hangs waiting for MASTER_ADDR
        # unless the agent's store is not shared with the rendezvous.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        "LOGLEVEL": "WARNING",
        "ELASTIC_FT_JOB_ID": macros.app_id,  # one job across restarts and nodes: checkpoint.lease.job_identity
    }
    if nproc_per_node > 1:
        # What torchrun sets itself for more than one process per node, set here so it
        # does not print its four-line banner about it on every start.
        out["OMP_NUM_THREADS"] = "1"
    if efa:
        # libfabric then fails loudly where the devices are missing, instead of NCCL falling back to TCP sockets.
        out["FI_PROVIDER"] = "efa"
    out.update(passthrough_env(environ))
    out.update(env or {})
    return out
