"""The workers' side of a lost node: the one line every surviving node prints when the job resumes,
and the one line for a collective that failed because a peer is gone.

The etcd3 rendezvous handler runs in each node's torchrun agent. When a round
forms without a node of the previous one, it puts why into the agent's
environment (:data:`~elastic_ft.handoff.lost_nodes.LOST_NODES_ENV`), which the workers it starts next
inherit: the agent knows which node left and why, the workers know from which
step and at which world the job resumes. :func:`announce` joins the two into
one event (the leader's ``events.jsonl``) and one log line per node (its
local rank 0), instead of dozens of lines of collective tracebacks.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Mapping

from elastic_ft.handoff.lost_nodes import LOST_NODES_ENV

log = logging.getLogger(__name__)


def departure_line(lost: str, step: int, world: int, source: str = "the last committed") -> str:
    """The line: ``lost`` as the agent put it, then where the job goes on (``source``: what holds that step)."""
    return f"{lost}; the job resumes after step {step} ({source}) at world size {world}"


def announce(events, *, step: int, world: int, local_rank: int,
             environ: Mapping[str, str] | None = None, source: str = "the last committed") -> str | None:
    """Emit ``node_lost`` and log the line when this round follows a lost node; the line, or None.

    ``events`` is the trainer's :class:`~elastic_ft.runevents.events.EventLog` (it writes
    only on the leader); ``step`` is the step the job resumes after, ``source`` what held it (the last
    commit, or a surviving node's memory).
    """
    lost = (os.environ if environ is None else environ).get(LOST_NODES_ENV)
    if not lost:
        return None
    line = departure_line(lost, step, world, source)
    events.emit("node_lost", quiet=True, reason=lost, resume_after_step=step, world=world)
    if local_rank == 0:
        log.warning("%s", line)
    return line


# gloo reports a peer that closed or reset its connection, or a wait that timed
# out, as a plain RuntimeError whose message starts with the gloo source file.
_GLOO = re.compile(r"^\[[^\]]*/gloo/transport/[^\]]*\]\s*")


def collective_failure(exc: BaseException) -> str | None:
    """One line for a collective that failed because a peer is gone (or silent past the timeout); None
    for anything else, whose traceback must show.

    Known kinds only: torch's distributed errors (NCCL, the process group's
    store) and gloo's transport errors (a plain RuntimeError naming gloo's
    transport source). The source path and gloo's advice are cut.
    """
    import torch.distributed as dist

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return f"{type(exc).__name__}: {text}"
    if type(exc) is RuntimeError and _GLOO.match(text):
        return _GLOO.sub("", text).split(". This is typically")[0]
    return None
