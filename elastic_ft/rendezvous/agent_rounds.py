"""A node lost while torch's agent assigns its workers' ranks: the survivors join a new round.

torch 2.13's agent (``SimpleElasticAgent._rendezvous``) takes a round from
``next_rendezvous()`` and then exchanges every node's role and local world
size through the round's store (``_assign_worker_ranks``): each agent writes
its own key, group rank 0 reads them all and writes the ranks, each agent
reads its own. A node lost in between leaves the others waiting for a key
that never comes. Our store ends that wait within a heartbeat with
:class:`~elastic_ft.rendezvous.store.WritersLostError`, but torch's agent has
no handler for an error there: it leaves ``_initialize_workers`` and the agent
exits 1 (on AWS Batch: never retried), although the only thing wrong is that
the round lost a member, which torch treats everywhere else as a membership
change (a new round, not counted against ``--max-restarts``).

No answer of the store or the handler can bring that new round: once
``next_rendezvous()`` returned, torch's agent keeps that round's group rank and
world size until its workers run, and answering a lost node's key with an
invented value would start workers in a world that does not exist (a survivor
could even take rank 0 of a world of one and train alongside the others). So
the agent's ``_rendezvous`` is wrapped, once per process, when the etcd3 handler
is built: a :class:`WritersLostError` (only our store raises it, only for a
round that lost a member) makes it run again, that is, join the next round,
exactly as torch's own ``_restart_workers`` would after stopping the workers
(none run yet). Any other error propagates unchanged. Bounded: past the
handler's join timeout a loss propagates as before.

The cost is one extra round per lost node, as for a node lost at any other time.

torch internals used: ``torch.distributed.elastic.agent.server.api.SimpleElasticAgent._rendezvous``
(name and ``(self, worker_group)`` signature), and ``worker_group.spec.rdzv_handler.settings.timeout.join``.
"""

from __future__ import annotations

import logging
import time

from .store import WritersLostError
from .torch_internals import wrap_agent_rendezvous

log = logging.getLogger(__name__)


def torch_version() -> str:
    import torch

    return torch.__version__

def rejoin_after_loss() -> None:
    """Make torch's agent join a new round when its round loses a node during the rank assignment (idempotent)."""

    def wrap(original):  # type: ignore[no-untyped-def]
        def _rendezvous(self, worker_group):  # type: ignore[no-untyped-def]
            handler = worker_group.spec.rdzv_handler
            settings = getattr(handler, "settings", None)
            join_s = settings.timeout.join.total_seconds() if settings is not None else 0.0
            deadline = time.monotonic() + join_s
            while True:
                try:
                    return original(self, worker_group)
                except WritersLostError as exc:
                    if time.monotonic() > deadline:
                        raise
                    log.warning(
                        "Rendezvous %r: a node of the round was lost while the agents assigned their workers' "
                        "ranks (%s). Joining a new round without it.", handler.get_run_id(), exc,
                    )

        return _rendezvous

    if not wrap_agent_rendezvous(wrap):
        log.warning(
            "torch %s's SimpleElasticAgent has no _rendezvous(self, worker_group) (elastic_ft knows torch "
            "2.13's): a node lost while the agents assign ranks will end the agent (exit 1), not start a "
            "new round.", torch_version(),
        )
