"""Which AWS Batch node this process runs on: array index and attempt, from Batch's environment.

Batch sets AWS_BATCH_JOB_ARRAY_INDEX in array children and
AWS_BATCH_JOB_ATTEMPT (from 1) in every job; the start event carries them so
that a node's events read against ``torchx log``'s ``JOBID:INDEX``.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

log = logging.getLogger(__name__)

ARRAY_INDEX = "AWS_BATCH_JOB_ARRAY_INDEX"
ATTEMPT = "AWS_BATCH_JOB_ATTEMPT"
_MAX_DIGITS = 6  # an index is below 10,000, an attempt at most 10


def _number(env: Mapping[str, str], name: str) -> Optional[int]:
    """The variable ``name`` as a number; None when unset, or (with a warning) when not 1-6 digits."""
    value = env.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS):
        log.warning("ignoring %s=%r: not a number of at most %d digits", name, value[:32], _MAX_DIGITS)
        return None
    return int(value)


def batch_node(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``"array index 3, attempt 2"`` on AWS Batch (either part alone if only it is set), else None.

    ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    index, attempt = _number(env, ARRAY_INDEX), _number(env, ATTEMPT)
    parts = []
    if index is not None:
        parts.append(f"array index {index}")
    if attempt is not None:
        parts.append(f"attempt {attempt}")
    return ", ".join(parts) or None
