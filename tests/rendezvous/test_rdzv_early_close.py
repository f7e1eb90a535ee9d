"""The round after a leave on a spot notice closes once the nodes that stay are in, not after the last call.

The decisions are pure (torch's own state objects, no etcd); the last test
runs three handlers in this process on a real etcd, one leaving on a notice
through its marker as its agent would, and times the survivors' next round
against a last call long enough to tell the two apart.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic_ft.rendezvous.spot_leave import CloseWhenExpected, EarlyCloseExecutor, may_close, staying_members
from elastic_ft.rendezvous.handler import create_handler
from elastic_ft.handoff.leave_marker import LeaveMarker, write_marker

from threads import run_in_threads

A, B, C = (_NodeDesc("host", pid, 0) for pid in (1, 2, 3))


def open_round(participants, wait_list=(), *, complete=False, closed=False) -> _RendezvousState:
    state = _RendezvousState()
    state.round = 4
    state.participants = {n: 0 for n in participants}
    state.wait_list = set(wait_list)
    state.complete, state.closed = complete, closed
    return state


def test_the_nodes_expected_are_the_last_rounds_members_but_the_leaving_ranks():
    members = {A: 0, B: 1, C: 2}
    assert staying_members(members, [0], "terminate") == {B, C}
    assert staying_members(members, [0, 2], "stop") == {B}


@pytest.mark.parametrize("members, leaving, kind", [
    ({A: 0, B: 1}, [0], "sigterm"),  # maybe the agent's own restart for a join: the node comes back
    ({A: 0, B: 1}, [], "terminate"),  # nobody named
    ({A: 0, B: 1}, [5], "terminate"),  # a rank of another round
    (None, [0], "terminate"),  # no round joined yet
    ({A: 0}, [0], "terminate"),  # nobody would stay
])
def test_no_expectation_where_the_marker_does_not_tell_who_comes(members, leaving, kind):
    assert staying_members(members, leaving, kind) is None


def test_a_round_closes_once_every_expected_node_has_joined():
    assert may_close(open_round([B, C]), B, {B, C}, 1, 3)
    assert may_close(open_round([B, C, A]), B, {B, C}, 1, 3)  # a newcomer already in is welcome
    assert not may_close(open_round([B]), B, {B, C}, 1, 3)  # C still restarting


@pytest.mark.parametrize("state, node, min_nodes", [
    (open_round([B, C], wait_list=[A]), B, 1),  # a node about to join keeps the last call
    (open_round([B, C], complete=True), B, 1),
    (open_round([B, C], closed=True), B, 1),
    (open_round([C]), B, 1),  # only a participant completes a round
    (open_round([B, C]), B, 3),  # fewer than min_nodes
])
def test_a_round_does_not_close_early_where_torch_would_not_close_it(state, node, min_nodes):
    assert not may_close(state, node, {C}, min_nodes, 3)


def settings(min_nodes=1, max_nodes=3) -> RendezvousSettings:
    return RendezvousSettings("r", min_nodes, max_nodes, RendezvousTimeout(last_call=timedelta(seconds=30)),
                              timedelta(seconds=5), 3)


def test_the_wrapped_join_completes_where_torchs_would_wait_and_is_torchs_otherwise():
    join = CloseWhenExpected(_RendezvousJoinOp(), frozenset({B}))
    deadline = time.monotonic() + 60
    now = datetime.now(timezone.utc)
    ready = open_round([B])  # B alone, its last call 30 s away: torch's join waits
    ready.last_heartbeats = {B: now}
    ready.deadline = now + timedelta(seconds=30)
    assert _RendezvousJoinOp()(_RendezvousContext(B, ready, settings()), deadline) == _Action.SYNC
    assert join(_RendezvousContext(B, ready, settings()), deadline) == _Action.MARK_RENDEZVOUS_COMPLETE
    outsider = open_round([])
    assert join(_RendezvousContext(B, outsider, settings()), deadline) == _Action.ADD_TO_PARTICIPANTS


def test_the_executor_wraps_only_the_join_and_only_while_expecting():
    seen = []

    class Inner:
        _state_holder = "holder"

        def run(self, op, deadline, update_deadline=None):
            seen.append(op)

    ex = EarlyCloseExecutor(Inner())
    join = _RendezvousJoinOp()
    ex.run(join, 0.0)
    ex.expected = frozenset({B})
    ex.run(join, 0.0)
    other = object()
    ex.run(other, 0.0)
    assert seen[0] is join and isinstance(seen[1], CloseWhenExpected) and seen[2] is other
    assert ex._state_holder == "holder"
    ex._state_holder = "new"  # the handler's factory replaces the holder through it
    assert ex._inner._state_holder == "new"


def test_survivors_of_a_notice_train_again_without_waiting_for_the_last_call(etcd, run_id):
    """Three nodes; the one at rank 0 leaves on a terminate notice. The last call is 30 s: torch's rule
    alone would hold the two survivors that long; they meet at once, in a world of two."""
    conf = {"last_call_timeout": "30", "join_timeout": "60", "keep_alive_interval": "1"}
    hs = [create_handler(RendezvousParameters("etcd3", etcd.endpoint, run_id, 1, 3, **conf)) for _ in range(3)]
    try:
        infos = run_in_threads(lambda i: hs[i].next_rendezvous(), 3)  # max_nodes: at once
        by_rank = {info.rank: h for info, h in zip(infos, hs)}
        leaver, survivors = by_rank[0], [by_rank[1], by_rank[2]]
        write_marker(leaver.leave_file, LeaveMarker(kind="terminate", step=9))
        for h in survivors:
            write_marker(h.leave_file, LeaveMarker(kind="terminate", step=9, stays=True, leaving=(0,)))
        with pytest.raises(SystemExit):  # NodeLeft: its agent exits 75 after leaving the rendezvous
            leaver.next_rendezvous()
        t0 = time.monotonic()
        again = run_in_threads(lambda i: survivors[i].next_rendezvous(), 2)
        took = time.monotonic() - t0
        assert sorted(i.rank for i in again) == [0, 1] and {i.world_size for i in again} == {2}
        assert took < 10, f"the survivors' round took {took:.1f} s: it waited for the 30 s last call"
    finally:
        for h in hs:
            h.etcd_client.close()
