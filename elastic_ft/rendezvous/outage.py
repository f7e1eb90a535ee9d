"""Riding out an etcd outage: training does not need etcd between membership changes.

While workers are healthy, torch's agent asks the handler for
``num_nodes_waiting()`` every monitor interval, and a keep-alive thread
refreshes this node's heartbeat (its liveness lease, see
:mod:`~elastic_ft.rendezvous.leased_heartbeats`). When etcd is away for
longer than the client's ``retry_timeout`` both fail; torch lets the first
kill the agent and its healthy workers. What must hold instead:

* ``num_nodes_waiting()`` reports no change (0) while etcd is unreachable
  (:class:`~elastic_ft.rendezvous.handler.EtcdRendezvousHandler`), and torch's
  keep-alive thread already logs its failures and keeps trying.
* When etcd answers again, every node's last heartbeat is as old as the
  outage, so torch would count every node dead at the first read and no node
  would send a heartbeat again (a node only refreshes a heartbeat the state
  still holds): a node joining later would then start a world of its own.
  :func:`heartbeats_may_expire` holds off dropping nodes for a while after
  etcd answers, time for each to send a heartbeat again (and to put back its
  liveness key, if etcd expired the leases while the clients could not reach it).
* If etcd lost its data (restarted on an empty data directory), the state key
  is gone while the job trains: the first node to notice writes back the state
  it last read (only if the key is still absent), with a new lease, so the
  nodes' membership and heartbeats come back (:func:`lost_running_state`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, RendezvousSettings

from .etcd import Outage
# torch's state holder is the only place that reads and writes the state for every
# node operation, and torch offers no public holder or hook to subclass: the adapter's.
from .leased_heartbeats import LeasedHeartbeatHolder
from .torch_internals import RendezvousState

log = logging.getLogger(__name__)

# The most time after etcd answers again (besides the heartbeat expiry) for
# every live node to write a heartbeat before stale ones count: each node's
# client may still be in a reconnect backoff (up to 2 s), then waits for its
# next keep-alive tick and may lose a few compare-and-set races.
GRACE_AFTER_OUTAGE = timedelta(seconds=30)


def heartbeats_may_expire(
    outage: Outage | None, now: float, expiry: timedelta, grace: timedelta = GRACE_AFTER_OUTAGE
) -> bool:
    """Whether a stale heartbeat may mark its node dead at ``now`` (wall clock).

    Not for a while after an outage ended: nobody could write a heartbeat
    during it, and the state a node holds may be older still (it was read
    before the nodes refreshed their heartbeats after an earlier outage, or
    written back after etcd lost its data). The while is ``expiry`` (torch:
    keep_alive_interval * keep_alive_max_attempt) plus the outage's length, at
    most ``grace``: time for every live node to write a heartbeat again, while
    a short blip delays the detection of a dead node only a little.
    """
    if outage is None:
        return True
    quiet_s = min(grace.total_seconds(), outage.seconds) + expiry.total_seconds()
    return now >= outage.ended + quiet_s


def lost_running_state(previous: RendezvousState, key_exists: bool) -> bool:
    """Whether the state key vanished under a running job (etcd lost its data).

    True only for a completed, open round with participants: a job that has not
    formed yet or was closed has nothing to restore.
    """
    return (
        not key_exists
        and previous.complete
        and not previous.closed
        and bool(previous.participants)
    )


class OutageTolerantStateHolder(LeasedHeartbeatHolder):
    """torch's state holder that drops no node right after an outage and repairs a lost state.

    It relies on torch's private holder through the adapter
    (:class:`~elastic_ft.rendezvous.torch_internals.StateHolder`): ``restore``
    writes back a lost state, ``key_found`` tells whether the last sync found
    the key, and ``may_drop_stale_nodes`` is asked where torch drops nodes
    with stale heartbeats.

    Args:
        backend: the rendezvous backend.
        settings: torch's rendezvous settings.
        outages: returns the latest etcd outage that has ended (the client's
            ``last_outage``), or ``None``.
        node: this node's descriptor: its heartbeats are lease refreshes
            (:class:`~elastic_ft.rendezvous.leased_heartbeats.LeasedHeartbeatHolder`).
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        settings: RendezvousSettings,
        outages: Callable[[], Outage | None],
        node: Any = None,
    ) -> None:
        super().__init__(backend, settings, node)
        self.settings = settings  # our own reference, not torch's private _settings
        self._outages = outages

    def sync(self) -> bool | None:
        """See base class; writes back the last state read if etcd lost it."""
        previous = self.state
        has_set = super().sync()
        # No token after a sync: the key was absent (get_state or set_state gave None).
        if lost_running_state(previous, key_exists=self.key_found()):
            log.warning(
                "The rendezvous state of %r is gone from etcd while round %d runs "
                "(etcd lost its data?); writing back the last state this node read.",
                self.settings.run_id,
                previous.round,
            )
            self.restore(previous)
            self.mark_dirty()  # with no token: written only if the key is still absent
            has_set = super().sync()
        return has_set

    def heartbeats_count(self) -> bool:
        """Whether a stale heartbeat means a dead node now (not right after an outage).

        Every decision from heartbeats asks this: torch's dropping of dead
        nodes here, and the handler's lost-node and closed-rendezvous checks.
        """
        settings = self.settings
        expiry = settings.keep_alive_interval * settings.keep_alive_max_attempt
        return heartbeats_may_expire(self._outages(), time.time(), expiry)

    def may_drop_stale_nodes(self) -> bool:
        """See base class; no node is dropped for a stale heartbeat right after an outage."""
        return self.heartbeats_count()
