"""The etcd3 rendezvous handler (the ``torchrun.handlers`` entry point is :mod:`.entry`).

``create_handler``
runs when ``--rdzv-backend=etcd3`` is actually used: it parses ``--rdzv-conf``,
connects to etcd (importing grpcio then; an unreachable endpoint fails
here, as torch's c10d backend fails when its TCPStore does not answer) and
returns torch's own
:class:`DynamicRendezvousHandler` over our backend and store.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable


from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

from ..handoff.leave_marker import (
    AT_EXIT, AT_ROUND, RECLAIM_EXIT_CODE, LeaveMarker, clear_marker, honoured, lost_note, read_marker,
)
from ..handoff.lost_nodes import LOST_NODES_ENV
from .agent_faults import hold_at
from .leased_heartbeats import release_liveness
from .lifecycle import LeaveOp, close_on_shutdown, departed, on_closed, reopen
from .liveness import LossDetection
from .meeting import meet
from .spot_leave import EarlyCloseExecutor, NodeLeft, hand_leave_file, peers_leave, staying_members
from .store import WritersLostError
from .torch_internals import (
    HandlerBase, heartbeat_lock, install_state_holder, op_executor, state_holder, stop_heartbeats, this_node,
    wrap_op_executor,
)

log = logging.getLogger(__name__)

# torch 2.13 otherwise makes the rank-0 agent host a TCPStore shared with the
# workers, so the job's store dies with that node, and a node joining a running
# job hangs (the new round never publishes MASTER_ADDR). With it set, each round
# publishes a fresh MASTER_ADDR/PORT through our etcd store instead.
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class EtcdRendezvousHandler(LossDetection, HandlerBase):
    """torch's dynamic rendezvous; the agent's store is etcd, never a node's TCPStore.

    Unlike c10d's TCPStore, the state in etcd outlives the job, so the handler
    adds what makes a run id reusable and a lost node survivable (the rules
    are in :mod:`elastic_ft.rendezvous.lifecycle`): ``shutdown()`` closes only
    for a job that completed, a new submission reopens a closed rendezvous,
    and a round whose node is lost before every node has met is started again
    rather than left waiting on its keys.
    """

    _etcd_away = False  # whether num_nodes_waiting() last found etcd unreachable

    etcd_client: Any = None
    """The etcd client under the store and backend (set by :func:`create_handler`);
    ``shutdown()`` closes it. Kept here rather than read from torch's private ``_store``."""

    etcd_store: Any = None
    """The agents' store (an :class:`~elastic_ft.rendezvous.store.EtcdStore`, set by
    :func:`create_handler`), where the members of a round meet. Kept here rather than
    read from torch's private ``_store``."""

    _peers_left: LeaveMarker | None = None  # other nodes left on a notice: read before this round
    _members: dict | None = None  # the last round this node joined: each member's rank

    leave_file: str | None = None
    """The leave marker this agent's workers write when the node leaves on a spot notice
    (:mod:`elastic_ft.handoff.leave_marker`); set by :func:`create_handler`."""

    # torch's private attributes are reached through .torch_internals, each for want of a public
    # interface (torch 2.13's DynamicRendezvousHandler exposes only ``settings``): the state holder
    # (to judge lost and closed nodes), the heartbeat lock (the keep-alive thread syncs that holder
    # too), this node's descriptor, the op executor (to run LeaveOp; wrapped to close a round early
    # after a leave), stop_heartbeats (shutdown() without closing) and on_round_complete (torch's
    # hook when a round completes).

    @property
    def use_agent_store(self) -> bool:
        """Workers must not look for a store on the agent: it lives in etcd.

        torch's agent reads this once per worker start, after the rank assignment.
        """
        hold_at("start_workers", (self._members or {}).get(this_node(self)))
        return False

    def num_nodes_waiting(self) -> int:
        """See base class, plus lost members; 0 (no change) while etcd does not answer.

        torch's agent calls this every monitor interval while the workers are
        healthy and restarts them (a new round) when it is above 0. torch
        counts only nodes waiting to join; a member of this node's round
        whose keep-alive expired (or that left, or a round that moved on)
        counts as 1 here too, so survivors whose collectives do not fail (a
        silent peer: no TCP reset; workers still starting) restart within the
        keep-alive expiry instead of after the collective timeout. The new
        round leaves the dead node out: torch's state sanitizer drops nodes
        whose heartbeat is older than the same expiry
        (``keep_alive_interval * keep_alive_max_attempt``, see :meth:`_liveness`).

        Training needs etcd only to change membership, so an outage is logged
        once and the workers go on; torch would let the error kill the agent
        and its workers. Other errors (permissions, corrupt state) raise.
        """
        from .etcd import EtcdUnavailableError

        try:
            # Both, so that every survivor logs its loss line even when another
            # survivor's rejoin (a waiting node) is what it sees first.
            waiting = super().num_nodes_waiting()
            # Under the lock as torch reads the state: the keep-alive thread syncs and sanitizes it.
            with heartbeat_lock(self):
                waiting = self._count_lost() or waiting
            # Other nodes leave on a spot notice and this node's workers committed and wait:
            # a change of membership, as for a node that joins.
            waiting = waiting or int(peers_leave(self.leave_file) is not None)
        except RendezvousConnectionError as exc:
            if not isinstance(exc.__cause__, EtcdUnavailableError):
                raise
            if not self._etcd_away:
                log.warning(
                    "etcd is unreachable; the workers of rendezvous %r go on training and "
                    "membership changes wait until etcd answers again (%s)",
                    self.settings.run_id,
                    exc.__cause__,
                )
            self._etcd_away = True
            return 0
        if self._etcd_away:
            log.warning("etcd answers again; rendezvous %r watches membership as before.",
                        self.settings.run_id)
            self._etcd_away = False
        return waiting

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class. Also reopens a closed rendezvous for a new submission,
        and starts a new round when a node of the round is lost before all met.

        Raises (besides the base class' errors):
            RendezvousClosedError: the job that closed the rendezvous still had
                live nodes when the join timeout passed (the message names them).
            NodeLeft: this node's workers left on a spot notice (they wrote the
                leave marker): the node left the rendezvous instead of joining.
        """
        self._leave_if_told(AT_ROUND)
        deadline = time.monotonic() + self.settings.timeout.join.total_seconds()
        # After other nodes left on a notice, the round closes once the rest are in (see spot_leave).
        left = self._peers_left
        op_executor(self).expected = left and staying_members(self._members, left.leaving, left.kind)
        try:
            while True:
                try:
                    info = super().next_rendezvous()
                    self._meet(info)
                    hold_at("assign_ranks", info.rank)
                    return info
                except RendezvousClosedError:
                    self._reopen_closed(deadline)
                except WritersLostError as exc:
                    if time.monotonic() > deadline:
                        raise
                    log.warning("Rendezvous %r: %s Starting a new round without the lost node(s).",
                                self.settings.run_id, exc)
        finally:
            op_executor(self).expected = None

    def _meet(self, info: RendezvousInfo) -> None:
        """Return from a round only once every participant has reached it (see :mod:`.meeting`): a node
        lost before then raises :class:`WritersLostError`, and :meth:`next_rendezvous` starts a new round."""
        round_, members = self._joined
        meet(self.etcd_store, round_, members, info.rank)

    def on_round_complete(self) -> None:
        """See base class (torch's hook once a round is complete): remember its members."""
        state = state_holder(self).state
        previous, self._joined = self._joined, (state.round, frozenset(state.participants))
        self._members = dict(state.participants)  # node -> rank: the ranks a leave marker names
        self._last_seen = dict(state.last_heartbeats)
        # The workers torch starts next inherit this process' environment: they
        # say which node left in their resume line (elastic_ft.train.peer_loss).
        lost = self._lost_since_round if self._peers_left is None else None
        lost = lost or departed(previous, self._joined[1], self._peers_left)
        if lost:
            os.environ[LOST_NODES_ENV] = lost
        else:
            os.environ.pop(LOST_NODES_ENV, None)
        self._lost_since_round = self._peers_left = None

    def _reopen_closed(self, deadline: float) -> None:
        """The join found the rendezvous closed: reopen it for this submission,
        wait for the job that closed it to finish exiting, or give up at ``deadline``."""
        announced = False
        while True:
            state_holder(self).sync()
            state = state_holder(self).state
            if not state.closed:
                return  # another node of this submission reopened it
            now = datetime.now(timezone.utc)
            decision = on_closed(state, this_node(self), now, self._liveness())
            if decision.reopen:
                reopen(state)
                state_holder(self).mark_dirty()
                if state_holder(self).sync():
                    log.info("Rendezvous %r: %s.", self.settings.run_id, decision.reason)
                    return
                continue  # another node wrote first: judge its state
            if time.monotonic() > deadline:
                raise RendezvousClosedError(
                    f"The rendezvous {self.settings.run_id!r} is closed: {decision.reason} after "
                    f"the join timeout ({self.settings.timeout.join}). Submit again once they "
                    f"have exited, or use another run id."
                )
            if not announced:
                log.info(
                    "Rendezvous %r: %s; waiting for them.", self.settings.run_id, decision.reason
                )
                announced = True
            time.sleep(1)  # as torch's own polling of the state

    def shutdown(self) -> bool:
        """Leave the rendezvous; close it only if the job completed.

        torch's launcher calls this after the agent's run whether it succeeded
        or failed; the exception in flight tells which (see
        :func:`~elastic_ft.rendezvous.lifecycle.close_on_shutdown`). Either way
        the node then removes itself, so a new submission need not wait for
        its heartbeat to go stale. Then the etcd connection is closed; it
        reopens by itself if the handler is used again, and closing frees the
        gRPC channel's threads in processes that build many handlers.

        Raises:
            NodeLeft: this node's workers left on a spot notice; the node left
                the rendezvous (open) and the agent exits with its status.
        """
        close, reason = close_on_shutdown(sys.exc_info()[1])
        try:
            self._leave_if_told(AT_EXIT)  # raises NodeLeft (the agent's exit status) after leaving
            if close:
                done = super().shutdown()  # stops the heartbeats, then closes
            else:
                stop_heartbeats(self)
                log.info("Rendezvous %r: not closing it: %s.", self.settings.run_id, reason)
                done = True
            return self._leave() and done
        finally:
            release_liveness(state_holder(self))  # the others need not wait for its lease to expire
            if self.etcd_client is not None:
                self.etcd_client.close()

    def _leave_if_told(self, where: str) -> None:
        """Leave the rendezvous, without closing it, if this node's workers left on a spot notice.

        Their marker is consumed either way; see :func:`~elastic_ft.handoff.leave_marker.honoured`
        for a SIGTERM's, which before a new round means this agent stopped its
        workers itself (a node joins) and the node stays.

        Raises:
            NodeLeft: the node left; the agent exits with :data:`RECLAIM_EXIT_CODE`.
        """
        if not self.leave_file:
            return
        clear_marker(lost_note(self.leave_file))  # a new round (or the exit): the lost peer is history
        marker = read_marker(self.leave_file)
        if marker is None:
            return
        clear_marker(self.leave_file)
        if marker.stays:
            self._peers_left = marker  # for the next round's loss line
            return
        if not honoured(marker, where):
            log.info("Rendezvous %r: the workers answered this agent's own SIGTERM; the node stays.",
                     self.settings.run_id)
            return
        stop_heartbeats(self)
        left = self._leave()  # the others need not wait for this node's heartbeat to go stale
        log.warning(
            "Node %s leaves rendezvous %r on a %s notice, step %d committed; %s. Exit status %d: a spot "
            "reclaim (resubmit the node to rejoin).",
            this_node(self), self.settings.run_id, marker.kind, marker.step,
            "the other nodes go on without it" if left else "the others drop it once its heartbeat is stale",
            RECLAIM_EXIT_CODE,
        )
        raise NodeLeft()

    def _leave(self) -> bool:
        """Remove this node from the rendezvous; on failure its heartbeat expires instead."""
        try:
            deadline = time.monotonic() + self.settings.timeout.close.total_seconds()
            op_executor(self).run(LeaveOp(), deadline)
            return True
        except RendezvousError as exc:
            log.warning(
                "Node %s could not leave rendezvous %r (%s: %s); the others drop it once its "
                "heartbeat is stale.",
                this_node(self),
                self.settings.run_id,
                type(exc).__name__,
                exc,
            )
            return False


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler for ``torchrun --rdzv-backend=etcd3``.

    Raises:
        ValueError: an invalid ``--rdzv-conf`` option (all of them listed).
        RendezvousConnectionError: no endpoint answered within ``retry_timeout``
            (it names them), or etcd refused the credentials.
    """
    from .agent_rounds import rejoin_after_loss
    from .backend import EtcdV3RendezvousBackend, connection_error
    from .etcd import EtcdClient, EtcdClientError
    from .leased_heartbeats import liveness_lease
    from .options import parse_options
    from .outage import OutageTolerantStateHolder
    from .store import EtcdStore

    options = parse_options(params.endpoint, params.config)
    # torch's agent starts each worker with a copy of its os.environ (torch 2.13's
    # SubprocessHandler), and workers never talk to etcd: they get no etcd password
    # nor state key. The options hold what was read.
    for name in options.secret_env:
        os.environ.pop(name, None)
    rejoin_after_loss()  # a node lost while the agents assign ranks: a new round (see agent_rounds)
    if os.environ.get(_SHARE_STORE_ENV) != "1":
        log.info("Setting %s=1: the etcd3 rendezvous keeps the agents' store in etcd.", _SHARE_STORE_ENV)
        os.environ[_SHARE_STORE_ENV] = "1"

    client = EtcdClient(options.connection, name=params.run_id)
    try:
        client.open()
    except EtcdClientError as exc:
        raise connection_error(exc) from exc
    run_prefix = options.run_prefix(params.run_id)
    backend = EtcdV3RendezvousBackend(client, params.run_id, run_prefix, secret=options.state_secret)
    log.log(*backend.codec.protection(params.run_id))  # one line per agent; WARNING without a key
    store = EtcdStore(client, run_prefix + "store/")
    timeout = RendezvousTimeout(join=options.join_timeout, last_call=options.last_call_timeout,
                                close=options.close_timeout, heartbeat=options.heartbeat_timeout)
    handler = EtcdRendezvousHandler.from_backend(
        run_id=params.run_id,
        store=store,
        backend=backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        timeout=timeout,
        keep_alive_interval=options.keep_alive_interval,
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )
    handler.etcd_client, handler.etcd_store = client, store
    hand_leave_file(handler, params.run_id)
    # torch builds its own state holder; ours (same state, same backend) also
    # rides out etcd outages. The op executor holds it too. Private attributes:
    # from_backend takes no holder, and the constructor that does needs torch's
    # private node descriptor (_NodeDesc), which from_backend generates.
    # Keep-alives are refreshes of a lease per node, not writes of the shared state (leased_heartbeats).
    backend.use_liveness_keys(*liveness_lease(client, run_prefix, this_node(handler), handler.settings))
    holder = OutageTolerantStateHolder(backend, handler.settings, lambda: client.last_outage, this_node(handler))
    install_state_holder(handler, holder)
    wrap_op_executor(handler, EarlyCloseExecutor)
    # A wait for a lost node's keys ends within a heartbeat of the node going stale.
    store.set_writer_check(handler._lost_writers, interval=options.keep_alive_interval)
    from ..preflight.startup import report_at_startup  # hostname, interfaces, versions: warnings only

    report_at_startup(client, run_prefix, params.max_nodes, [e.host for e in options.connection.endpoints])
    return handler
