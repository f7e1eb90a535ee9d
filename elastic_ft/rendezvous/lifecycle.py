"""When a run's rendezvous closes, reopens, and gives up on a lost node: pure decisions.

torch's dynamic rendezvous keeps one state per run id; with the etcd3 backend
that state outlives the job (it expires ``lease_ttl`` after the last agent),
where c10d's TCPStore dies with its job. Three rules make a run id behave on
etcd3 as it does on c10d, where every submission starts afresh:

- **Close only for a completed job.** torch's launcher calls the handler's
  ``shutdown()`` after the agent's run on success and on failure alike (from a
  ``finally`` clause: workers failed past ``--max-restarts``, a store or
  rendezvous timeout). A closed rendezvous turns every later agent away, so an
  agent that fails, gives up or leaves must only remove itself
  (:func:`close_on_shutdown`).
- **A new submission reopens a closed rendezvous** once no node of the job that
  closed it is alive: a new round number, so the agents' store keys of the new
  round are fresh too (torch prefixes them with the round). A node that arrives
  while a live job runs finds it open and joins it (:func:`on_closed`).
- **A wait for a lost node's keys ends** as soon as the rendezvous shows the
  node gone (its heartbeat stale, or it left), not after the store's 300 s
  (:func:`lost_members`); the handler then starts a new round.

The functions take the clock as an argument and do no I/O; the handler
(:mod:`elastic_ft.rendezvous.handler`) reads and writes the state around them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Collection, Mapping

# The rendezvous state and the op protocol (a context in, an action out) that LeaveOp
# implements are torch's private names, reached through the adapter.
from .torch_internals import Action, RendezvousContext, RendezvousState


def close_on_shutdown(propagating: BaseException | None) -> tuple[bool, str]:
    """Whether ``shutdown()`` may close the rendezvous, and why.

    ``propagating`` is the exception in flight where ``shutdown()`` was called
    (``sys.exc_info()``): torch's launcher calls it from a ``finally`` clause,
    so an exception there means the agent failed (``ChildFailedError``: the
    workers failed past ``--max-restarts``; a rendezvous or store timeout;
    a lost etcd). Only a clean return -- the agent's workers succeeded -- closes.
    """
    if propagating is None:
        return True, "the job completed"
    return False, (
        f"the agent is failing ({type(propagating).__name__}: {propagating}); it leaves the "
        f"rendezvous open for the other nodes and for a new submission"
    )


def live_nodes(
    state: RendezvousState, now: datetime, liveness: timedelta | None, exclude: Any = None
) -> list[Any]:
    """Nodes whose last heartbeat is younger than ``liveness`` (torch's own rule:
    ``keep_alive_interval * keep_alive_max_attempt``), except ``exclude``.

    ``liveness`` None: every node with a heartbeat counts as alive, as right
    after an etcd outage, when nobody could write one (see
    :func:`~elastic_ft.rendezvous.outage.heartbeats_may_expire`).
    """
    return sorted(
        node
        for node, beat in state.last_heartbeats.items()
        if node != exclude and (liveness is None or beat >= now - liveness)
    )


@dataclass(frozen=True)
class ClosedDecision:
    """What a joining node does with a closed rendezvous."""

    reopen: bool
    """True: start a new round; False: wait for ``waiting_for`` to exit."""

    reason: str
    waiting_for: tuple[Any, ...] = ()


def on_closed(
    state: RendezvousState, node: Any, now: datetime, liveness: timedelta | None
) -> ClosedDecision:
    """A joining ``node`` found ``state`` closed: reopen it, or wait.

    Closed means a job of this run id completed. If none of its nodes is alive
    (each removes itself when it shuts down; a crashed one stops heartbeating),
    this node belongs to a new submission: reopen. If some are alive, that job
    is still finishing (its agents in their exit barrier): wait for them rather
    than run a second job beside it.
    """
    alive = live_nodes(state, now, liveness, exclude=node)
    if not alive:
        return ClosedDecision(
            True,
            f"round {state.round} was closed by a completed job and none of its nodes is alive; "
            f"a new submission opens round {state.round + 1}",
        )
    names = ", ".join(str(n) for n in alive)
    return ClosedDecision(
        False,
        f"round {state.round} was closed by a completed job whose nodes ({names}) are still "
        f"exiting",
        tuple(alive),
    )


def reopen(state: RendezvousState) -> None:
    """Turn a closed ``state`` into an empty, open rendezvous at the next round.

    In place, as torch's own state transitions are. The round goes up so that
    the agents' store keys (torch prefixes them with the round) start empty.
    """
    state.round += 1
    state.complete = False
    state.deadline = None
    state.closed = False
    state.participants = {}
    state.wait_list = set()
    state.redundancy_list = set()
    state.last_heartbeats = {}


def lost_members(
    state: RendezvousState,
    round_: int,
    members: Collection[Any],
    node: Any,
    now: datetime,
    liveness: timedelta | None,
    last_seen: Mapping[Any, datetime] | None = None,
) -> str | None:
    """Why the nodes of round ``round_`` can no longer all meet, or ``None``.

    ``last_seen`` (each member's newest heartbeat the asker ever read) makes a
    member missing from the participants count only once that heartbeat is
    older than ``liveness``: a member that is restarting also leaves the
    participants (with its heartbeat) before it rejoins, where a dead one's
    last heartbeat only ages. Without it, a missing member is lost at once.

    ``members`` are the round's participants when it completed. A member that
    left the participants (it shut down, or torch dropped it for a stale
    heartbeat) or whose heartbeat is older than ``liveness`` will never write
    its store keys; a round number other than ``round_`` means the other nodes
    have already moved on to a new round. ``node``, the one asking, is alive
    whatever its heartbeat says (a late heartbeat is its own timer's lag).
    """
    if state.round != round_:
        return f"the rendezvous moved on from round {round_} to round {state.round}"
    alive = set(live_nodes(state, now, liveness))
    why = []
    for m in sorted(members):
        if m == node:
            continue
        if m not in state.participants:
            if last_seen is not None and (
                liveness is None or m in state.wait_list or last_seen.get(m, now) >= now - liveness
            ):
                continue  # restarting: it rejoins, or it heartbeat recently
            if last_seen is not None and m in last_seen:
                age = (now - last_seen[m]).total_seconds()
                why.append(f"{m} (keep-alive expired: no heartbeat for {age:.0f} s)")
            else:
                # torch's sanitizer removes an expired node from the participants
                # (on whichever node read the state first), so this covers both.
                why.append(f"{m} (left the round: it exited, or its keep-alive expired)")
        elif m not in alive:
            beat = state.last_heartbeats.get(m)
            seen = "never" if beat is None else f"{(now - beat).total_seconds():.0f} s ago"
            why.append(f"{m} (keep-alive expired: last heartbeat {seen})")
    if why:
        return f"node(s) {', '.join(why)} of round {round_} lost"
    return None


def departed(previous: tuple[int, Collection[Any]] | None, members: Collection[Any],
             notice: Any = None) -> str | None:
    """Which nodes of the ``previous`` round (its number and members) are not among ``members``, or None.

    ``notice``: the leave marker of this node's workers when other nodes left
    on a spot notice (its ``kind`` and committed ``step``). Without one, a loss
    the agent did not see itself (its workers failed first: the lost node's
    connections closed), so the reason is what that implies.
    """
    if previous is None:
        return None
    gone = sorted(set(previous[1]) - set(members))
    if not gone:
        return None
    names = ", ".join(str(m) for m in gone)
    if notice is not None:
        return f"node(s) {names} of round {previous[0]} left on a spot {notice.kind} notice, step {notice.step} committed"
    return f"node(s) {names} of round {previous[0]} lost (they exited or left; the workers' collectives failed)"


class LeaveOp:
    """torch rendezvous operation: remove this node from whichever list holds it.

    Used by a shutting-down agent so the others need not wait for its heartbeat
    to go stale. Runs in torch's op executor like torch's own operations.
    """

    def __call__(self, ctx: RendezvousContext, deadline: float) -> Action:
        state = ctx.state
        if ctx.node in state.participants:
            action = Action.REMOVE_FROM_PARTICIPANTS
        elif ctx.node in state.wait_list:
            action = Action.REMOVE_FROM_WAIT_LIST
        elif ctx.node in state.redundancy_list:
            action = Action.REMOVE_FROM_REDUNDANCY_LIST
        else:
            return Action.FINISH
        if time.monotonic() > deadline:
            return Action.ERROR_TIMEOUT
        return action
