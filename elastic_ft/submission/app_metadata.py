"""The AppDef metadata of an ``elastic_ft.train`` app: one definition of its keys, for the component and the scheduler.

:data:`MARKER` marks an app as the component's (value ``"train"``); the other
keys are the facts a scheduler checks without parsing the bash line
(``elastic_ft.aws_batch`` does). torchx's aws_batch and aws_sagemaker
schedulers copy metadata into AWS tags, so every value is tag-safe: at most
256 characters of letters, digits, spaces and ``_.:/=+-@``.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

MARKER = "elastic_ft.component"
MIN_NODES = "elastic_ft.min_nodes"
MAX_NODES = "elastic_ft.max_nodes"
RDZV_BACKEND = "elastic_ft.rdzv_backend"
RDZV_ENDPOINT = "elastic_ft.rdzv_endpoint"
"""``"given"`` when the user named an endpoint, else empty (the component's default)."""
CHECKPOINT_SCHEME = "elastic_ft.checkpoint_scheme"
RUN_ID = "elastic_ft.run_id"

_TAG_SAFE = re.compile(r"^[A-Za-z0-9 _.:/=+@-]{0,256}$")


def app_metadata(
    lo: int,
    hi: int,
    rdzv_backend: str,
    rdzv_endpoint: Optional[str],
    checkpoint_uri: str,
    run_id: Optional[str],
) -> Dict[str, str]:
    """The marker and the structured facts, each value tag-safe.

    The checkpoint URI itself may hold any character S3 keys allow, so only its
    scheme is kept; a backend name that is not tag-safe is kept as ``"other"``.
    """
    scheme = checkpoint_uri.partition("://")[0] if "://" in checkpoint_uri else ""
    return {
        MARKER: "train",
        MIN_NODES: str(lo),
        MAX_NODES: str(hi),
        RDZV_BACKEND: rdzv_backend if _TAG_SAFE.match(rdzv_backend) else "other",
        RDZV_ENDPOINT: "given" if rdzv_endpoint else "",
        CHECKPOINT_SCHEME: scheme if scheme.isalnum() else "other",
        # check_name keeps run ids to letters, digits, '.', '_' and '-', at most 128.
        RUN_ID: run_id or "",
    }
