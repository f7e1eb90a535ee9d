"""How the etcd3 handler judges that a member of its round is lost: a mixin of
:class:`~elastic_ft.rendezvous.handler.EtcdRendezvousHandler`.

Two callers: torch's agent, through ``num_nodes_waiting`` (a lost member
restarts this node's workers in a new round, also when no collective fails:
a silent peer, workers still starting), and the store's writer check (a
wait for a lost node's keys ends). Both judge the rendezvous state with
:func:`~elastic_ft.rendezvous.lifecycle.lost_members`, against the keep-alive
expiry torch's state sanitizer uses.

The mixin reads the state holder, heartbeat lock and node descriptor of the
handler it is mixed into through :mod:`elastic_ft.rendezvous.torch_internals`.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous import RendezvousError

from ..handoff.leave_marker import note_peer_lost
from .lifecycle import lost_members
from .torch_internals import heartbeat_lock, state_holder, this_node

log = logging.getLogger(__name__)


class LossDetection:
    """Lost-member checks of a dynamic rendezvous handler (mixed in before torch's class)."""

    # The round this node last joined and its participants then: the nodes
    # whose store keys the agent waits for (see _lost_writers).
    _joined: tuple[int, frozenset] | None = None
    _announced_loss: tuple[int, frozenset] | None = None  # the round whose lost member was logged
    _lost_since_round: str | None = None  # why the round this node last joined lost a member
    _last_seen: dict  # the newest heartbeat read of each member of that round (set by _get_store)
    leave_file: str | None  # the handler's (see there): the lost note lies beside it

    def _liveness(self) -> timedelta | None:
        """How old a heartbeat may be for its node to count as alive; None (any
        age) right after an etcd outage, which held every heartbeat up."""
        if not state_holder(self).heartbeats_count():
            return None
        return self.settings.keep_alive_interval * self.settings.keep_alive_max_attempt

    def _lost_writers(self) -> str | None:
        """The store's writer check: why this round's nodes cannot all meet, or None.

        An etcd fault answers None (keep waiting): only a rendezvous that was
        read and shows a node gone may end a wait.
        """
        if self._joined is None:
            return None
        try:
            with heartbeat_lock(self):
                state_holder(self).sync()
        except RendezvousError as exc:
            log.warning(
                "Could not read rendezvous %r to check its nodes: %s", self.settings.run_id, exc
            )
            return None
        return self._lost_reason()

    def _lost_reason(self, last_seen: dict | None = None) -> str | None:
        """Why this node's round lost a member, judged on the state last synced; None if it did not.

        ``last_seen``: see :func:`~elastic_ft.rendezvous.lifecycle.lost_members`.
        """
        joined = self._joined
        if joined is None:
            return None
        now = datetime.now(timezone.utc)
        return lost_members(
            state_holder(self).state, joined[0], joined[1], this_node(self), now, self._liveness(),
            last_seen,
        )

    def _count_lost(self) -> int:
        """1 (a membership change, for torch's agent) once this node's round lost a member, else 0.

        Judged on the state ``num_nodes_waiting`` just synced. Logged once per
        round, as the one line that says which node left and why.
        """
        if self._joined is None:
            return 0
        holder = state_holder(self)
        beats = holder.state.last_heartbeats
        # A member whose liveness lease expired (leased_heartbeats) was last seen at its stored
        # heartbeat, or at least its lease's TTL ago, not at the reads that still found its key:
        # it is not "restarting" (a restarting node keeps its lease).
        lapsed = getattr(holder, "lapsed", {})
        gone = getattr(holder, "lease_gone", lambda node: False)
        liveness, now = self._liveness(), datetime.now(timezone.utc)
        for member in self._joined[1]:
            if member in lapsed:
                self._last_seen[member] = lapsed[member]
            elif member in beats:
                self._last_seen[member] = max(beats[member], self._last_seen.get(member, beats[member]))
            elif liveness is not None and gone(member):
                self._last_seen[member] = min(self._last_seen.get(member, now), now - liveness)
        reason = self._lost_reason(self._last_seen)
        if reason is None:
            return 0
        if self.leave_file:  # before torch's agent stops the workers: they need not wait for a boundary
            note_peer_lost(self.leave_file)
        joined = self._joined
        if self._announced_loss != joined:
            self._announced_loss = joined
            self._lost_since_round = reason
            log.warning(
                "Rendezvous %r: %s; restarting this node's workers in a new round without them.",
                self.settings.run_id,
                reason,
            )
        return 1
