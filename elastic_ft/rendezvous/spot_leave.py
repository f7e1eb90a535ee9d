"""The agent's side of a node's leave on a spot notice (the shared marker: :mod:`elastic_ft.handoff.leave_marker`;
the workers' side: :mod:`elastic_ft.train.preemption`).

**Leaving.** :class:`NodeLeft` is how the etcd3 handler ends its torchrun
agent with the reclaim status; :func:`hand_leave_file` gives the agent its
marker path (in a private directory of its own), hands it to the workers
through the environment, and reads it once more at exit; :func:`peers_leave`
tells it that its workers stay while other nodes leave.

**Closing the next round early.**
torch's dynamic rendezvous completes a round when ``max_nodes`` have joined,
or ``last_call_timeout`` after ``min_nodes`` had: with fewer nodes than the
maximum (a node just left on a spot notice) the survivors always wait the
whole last call (3 s by default, torch's own 30 s), though they know who
they are waiting for. When this node's workers stayed while others left on
an IMDS notice (their marker names the leaving nodes' ranks in the round,
see :mod:`elastic_ft.handoff.leave_marker`), the nodes expected in the next round are
the members of the last one minus those; once all of them have joined, and
no other node waits to join, the round is marked complete at once.

Conservative by design, so torch's rendezvous contract holds:

- it only ever completes a round torch would complete later anyway (enough
  participants, not closed, this node among them); a round that never sees
  every expected node waits for the last call exactly as before;
- a node in the wait list keeps the last call: it is about to join, and
  closing without it would cost everyone a second round;
- a ``sigterm`` marker never closes early: a worker cannot tell a container
  stop from its agent's own restart for a joining node, after which the
  "leaving" node comes back (:func:`~elastic_ft.handoff.leave_marker.honoured`);
- without a marker (every round torch's own tests run) nothing changes.

:func:`staying_members` and :func:`may_close` decide, from plain values;
:class:`CloseWhenExpected` wraps torch's join operation with them, and
:class:`EarlyCloseExecutor` wraps the handler's operation executor so that
the join torch's ``next_rendezvous`` builds is wrapped while an expectation
is set.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Any, Callable, Collection, Mapping, Protocol

from ..handoff.leave_marker import (
    AT_EXIT, LEAVE_FILE_ENV, RECLAIM_EXIT_CODE, LeaveMarker, marker_path, read_marker, remove_marker_dir,
)
from .torch_internals import Action, RendezvousContext, RendezvousJoinOp, RendezvousState

log = logging.getLogger(__name__)


class _Leaving(Protocol):
    """What this module needs of :class:`~elastic_ft.rendezvous.handler.EtcdRendezvousHandler`
    (named here, not imported: the handler imports this module)."""

    leave_file: str | None

    def _leave_if_told(self, where: str) -> None: ...


class NodeLeft(SystemExit):
    """Ends a torchrun agent whose node left on a spot notice, with :data:`RECLAIM_EXIT_CODE`.

    A ``SystemExit`` rather than torch's ``RendezvousGracefulExitError``: torch
    2.13's ``SimpleElasticAgent.run()`` swallows that error and returns None,
    which ``launch_agent`` then dereferences (an AttributeError: exit 1 with a
    traceback). A ``SystemExit`` passes torch's ``except Exception`` clauses
    while their ``finally`` clauses still stop the workers and call
    ``shutdown()``, and torchrun exits with its code.
    """

    def __init__(self) -> None:
        super().__init__(RECLAIM_EXIT_CODE)


def hand_leave_file(handler: _Leaving, run_id: str) -> None:
    """Give the agent a fresh leave marker path, tell its workers (environment), and read it at exit.

    At exit: a torchrun agent stopped by a signal (a container stop) never calls
    ``shutdown()`` (torch keeps the rendezvous open for the others), so an
    ``atexit`` hook leaves for a node whose workers left on the signal.
    """
    handler.leave_file = marker_path(run_id)  # a new private directory (0700), removed at exit
    os.environ[LEAVE_FILE_ENV] = handler.leave_file
    # atexit runs its hooks last registered first: the directory goes after the last read.
    atexit.register(remove_marker_dir, handler.leave_file)
    # A strong reference: after a signal, torch's frames that held the handler are gone.
    atexit.register(_leave_at_exit, handler)


def peers_leave(leave_file: str | None) -> LeaveMarker | None:
    """The marker of the agent's workers when they stay while other nodes leave (they committed and wait
    for a restart in a new round), or None. Cheap without one (a stat): called every monitor interval."""
    if not leave_file or not os.path.lexists(leave_file):
        return None
    marker = read_marker(leave_file)
    return marker if marker is not None and marker.stays else None


def _leave_at_exit(handler: _Leaving) -> None:
    try:
        handler._leave_if_told(AT_EXIT)  # our method (not torch's)
    except NodeLeft as exc:
        # An exception from an atexit hook would only be printed: end the
        # process with the reclaim status instead (the workers are gone).
        # os._exit skips the hooks still due, the directory's removal among them.
        if handler.leave_file:
            remove_marker_dir(handler.leave_file)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(exc.code))


def staying_members(members: Mapping[Any, int] | None, leaving: Collection[int], kind: str) -> frozenset | None:
    """The nodes expected in the round after ``leaving`` (ranks in the last round) left on a ``kind`` notice.

    ``members`` maps each node of the last round this agent joined to its
    rank there. None (no early close) without members or leaving ranks, for
    a ``sigterm`` (see the module docstring), or when a leaving rank is not a
    member (the marker is not about this round).
    """
    if not members or not leaving or kind == "sigterm":
        return None
    ranks = set(members.values())
    if not set(leaving) <= ranks:
        return None
    stay = frozenset(node for node, rank in members.items() if rank not in set(leaving))
    return stay or None


def may_close(state: RendezvousState, node: Any, expected: Collection[Any], min_nodes: int,
              max_nodes: int) -> bool:
    """Whether ``node`` may mark the open round of ``state`` complete now: every ``expected`` node has
    joined, no node waits to join, and the count is one torch would complete the round with."""
    participants = state.participants
    return (
        not state.complete
        and not state.closed
        and node in participants
        and min_nodes <= len(participants) <= max_nodes
        and not state.wait_list
        and set(expected) <= participants.keys()
    )


class CloseWhenExpected:
    """torch's join operation, completing the round at once where :func:`may_close` allows.

    Only a ``SYNC`` (wait for others, one second a time) is turned into
    ``MARK_RENDEZVOUS_COMPLETE``; every other action, the timeouts included,
    is torch's.
    """

    def __init__(self, join: Callable[[RendezvousContext, float], Action], expected: frozenset) -> None:
        self.join, self.expected = join, expected

    def __call__(self, ctx: RendezvousContext, deadline: float) -> Action:
        action = self.join(ctx, deadline)
        s = ctx.settings
        if action == Action.SYNC and may_close(ctx.state, ctx.node, self.expected, s.min_nodes, s.max_nodes):
            log.info("Rendezvous %r: every node that stays after the leave has joined round %d; closing it "
                     "without waiting for the last call", s.run_id, ctx.state.round)
            return Action.MARK_RENDEZVOUS_COMPLETE
        return action


class EarlyCloseExecutor:
    """The handler's operation executor, wrapping torch's join in :class:`CloseWhenExpected` while
    :attr:`expected` is set. Everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.expected: frozenset | None = None
        """The nodes the next round waits for before it closes early; None: torch's rules alone."""

    def run(self, state_handler: Callable[[RendezvousContext, float], Action], deadline: float,
            update_deadline: Callable[[Any], float] | None = None) -> None:
        if self.expected and isinstance(state_handler, RendezvousJoinOp):
            state_handler = CloseWhenExpected(state_handler, self.expected)
        self._inner.run(state_handler, deadline, update_deadline)

    def __getattr__(self, name: str) -> Any:  # torch's executor's own attributes (its state holder)
        if name == "_inner":  # not set yet (a copy being built): no endless lookup
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_inner", "expected"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)
