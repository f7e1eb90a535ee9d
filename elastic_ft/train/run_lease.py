"""The trainer's side of the run's writer lease (:mod:`elastic_ft.checkpoint.lease`): taken by the leader at
start, known to every rank, checked before each commit, released at the end.

A second live writer of a run (another job started with the same run id and checkpoint location) is
refused at start, on every rank alike, naming the run and the writer that holds it. A restart of the
same job (a new world, a new leader) takes its own run's lease over at once
(:func:`~elastic_ft.checkpoint.lease.job_identity`). Cost: one LIST and one PUT at start, one LIST per
commit, one PUT per renewal.
"""

from __future__ import annotations

import os
import socket

from elastic_ft.checkpoint.lease import DEFAULT_TTL_S, Holder, LeaseHeld, WriterLease, job_identity
from elastic_ft.checkpoint.store import ObjectStore, StoreError
from elastic_ft.checkpoint.writer import new_writer_token
from elastic_ft.train.world import World, broadcast_from_leader


def hold(world: World, store: ObjectStore, run_id: str, *, ttl_s: float = DEFAULT_TTL_S) -> WriterLease | None:
    """The leader's lease on the run (None on the other ranks), renewed in the background.

    A collective: raises :class:`~elastic_ft.checkpoint.lease.LeaseHeld` on every rank when another
    writer holds the run, and :class:`StoreError` on every rank when the store could not answer.
    """
    lease, problem = None, None
    if world.is_leader:
        holder = Holder(job=job_identity(), writer=new_writer_token(), host=socket.gethostname(), pid=os.getpid())
        lease = WriterLease(store, run_id, holder, ttl_s=ttl_s)
        try:
            lease.acquire()
            lease.start_renewing()
        except StoreError as exc:
            problem = (isinstance(exc, LeaseHeld), str(exc))
    problem = broadcast_from_leader(world, problem)
    if problem is not None:
        held, message = problem
        raise (LeaseHeld if held else StoreError)(
            message if held else f"the writer lease of run {run_id!r} could not be taken: {message}")
    return lease
