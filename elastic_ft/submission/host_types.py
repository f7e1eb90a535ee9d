"""Named host types torchx 0.7.0 does not know: AWS's g6 (NVIDIA L4, 24 GB) and g6e (L40S, 48 GB).

torchx names the p3/p4d/p5, g4dn and g5 (A10G, 24 GB) types (``torchx.specs.named_resources_aws``); the
cheapest Spot GPUs a Q-LoRA job of an 8B model fits on (specs/llama-3.1-8b-qlora-spot.yaml) are g5 and g6,
and the LoRA spec's pools (infra/aws/batch.yaml) are g6e. These follow torchx's conventions: memory less
the 4% that ECS and Batch keep (``MEM_TAX``), the instance type as a capability (for mixed compute
environments). No EFA interfaces are declared (the larger sizes have them; ``--efa N`` states them).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torchx.specs as specs
from torchx.specs.named_resources_aws import GiB, K8S_ITYPE

# instance type -> (vCPUs, memory in GiB, GPUs), from AWS's instance type pages.
_SIZES = {
    "g6.xlarge": (4, 16, 1), "g6.2xlarge": (8, 32, 1), "g6.4xlarge": (16, 64, 1), "g6.8xlarge": (32, 128, 1),
    "g6.12xlarge": (48, 192, 4), "g6.16xlarge": (64, 256, 1), "g6.24xlarge": (96, 384, 4),
    "g6.48xlarge": (192, 768, 8),
    "g6e.xlarge": (4, 32, 1), "g6e.2xlarge": (8, 64, 1), "g6e.4xlarge": (16, 128, 1), "g6e.8xlarge": (32, 256, 1),
    "g6e.12xlarge": (48, 384, 4), "g6e.16xlarge": (64, 512, 1), "g6e.24xlarge": (96, 768, 4),
    "g6e.48xlarge": (192, 1536, 8),
}


def _factory(itype: str, cpu: int, mem_gib: int, gpu: int) -> Callable[[], specs.Resource]:
    def resource() -> specs.Resource:
        return specs.Resource(cpu=cpu, gpu=gpu, memMB=mem_gib * GiB, capabilities={K8S_ITYPE: itype})

    return resource


HOST_TYPES: Dict[str, Callable[[], specs.Resource]] = {
    f"aws_{itype}": _factory(itype, *size) for itype, size in _SIZES.items()
}
"""``-h`` names (as torchx spells its own: ``aws_g6.xlarge``) -> their resource."""


def node_resource(*, cpu: int, gpu: int, memMB: int, h: Optional[str]) -> specs.Resource:
    """A node's resource: the named host type ``h`` (ours, else torchx's), else ``cpu``/``gpu``/``memMB``."""
    if h in HOST_TYPES:
        return HOST_TYPES[h]()
    return specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h)
