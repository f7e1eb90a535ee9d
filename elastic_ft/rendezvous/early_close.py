"""The round after an announced leave closes as soon as every node that stays has joined.

torch's dynamic rendezvous completes a round when ``max_nodes`` have joined,
or ``last_call_timeout`` after ``min_nodes`` had: with fewer nodes than the
maximum (a node just left on a spot notice) the survivors always wait the
whole last call (3 s by default, torch's own 30 s), though they know who
they are waiting for. When this node's workers stayed while others left on
an IMDS notice (their marker names the leaving nodes' ranks in the round,
see :mod:`elastic_ft.spot.leave`), the nodes expected in the next round are
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
  "leaving" node comes back (:func:`~elastic_ft.spot.leave.honoured`);
- without a marker (every round torch's own tests run) nothing changes.

:func:`staying_members` and :func:`may_close` decide, from plain values;
:class:`CloseWhenExpected` wraps torch's join operation with them, and
:class:`EarlyCloseExecutor` wraps the handler's operation executor so that
the join torch's ``next_rendezvous`` builds is wrapped while an expectation
is set.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection, Mapping

# Private torch names: the join operation and the op protocol (a context in, an action out)
# have no public counterparts in torch 2.13.
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

log = logging.getLogger(__name__)


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


def may_close(state: _RendezvousState, node: Any, expected: Collection[Any], min_nodes: int,
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

    def __init__(self, join: Callable[[_RendezvousContext, float], _Action], expected: frozenset) -> None:
        self.join, self.expected = join, expected

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        action = self.join(ctx, deadline)
        s = ctx.settings
        if action == _Action.SYNC and may_close(ctx.state, ctx.node, self.expected, s.min_nodes, s.max_nodes):
            log.info("Rendezvous %r: every node that stays after the leave has joined round %d; closing it "
                     "without waiting for the last call", s.run_id, ctx.state.round)
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return action


class EarlyCloseExecutor:
    """The handler's operation executor, wrapping torch's join in :class:`CloseWhenExpected` while
    :attr:`expected` is set. Everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.expected: frozenset | None = None
        """The nodes the next round waits for before it closes early; None: torch's rules alone."""

    def run(self, state_handler: Callable[[_RendezvousContext, float], _Action], deadline: float,
            update_deadline: Callable[[Any], float] | None = None) -> None:
        if self.expected and isinstance(state_handler, _RendezvousJoinOp):
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
