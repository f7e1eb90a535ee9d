"""The rendezvous lifecycle decisions (elastic_ft.rendezvous.lifecycle), on torch's own state type."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousState,
)

from elastic_ft.rendezvous.lifecycle import (
    LeaveOp,
    close_on_shutdown,
    lost_members,
    on_closed,
    reopen,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
LIVENESS = timedelta(seconds=15)
A, B, C = (_NodeDesc("host", pid, 0) for pid in (1, 2, 3))


def state_with(**heartbeats_age_s: float) -> _RendezvousState:
    """A complete round whose participants are the named nodes, with heartbeats that old."""
    nodes = {"a": A, "b": B, "c": C}
    state = _RendezvousState()
    state.round = 4
    state.complete = True
    for rank, (name, age) in enumerate(sorted(heartbeats_age_s.items())):
        state.participants[nodes[name]] = rank
        state.last_heartbeats[nodes[name]] = NOW - timedelta(seconds=age)
    return state


def test_close_only_when_no_exception_is_propagating():
    assert close_on_shutdown(None)[0] is True
    close, reason = close_on_shutdown(RuntimeError("workers failed"))
    assert close is False
    assert "RuntimeError: workers failed" in reason and "open" in reason


def test_closed_without_live_nodes_is_reopened_at_the_next_round():
    state = state_with(a=100, b=20)
    state.closed = True
    decision = on_closed(state, C, NOW, LIVENESS)
    assert decision.reopen
    assert "round 5" in decision.reason


def test_closed_with_an_empty_state_after_every_node_left_is_reopened():
    state = _RendezvousState()
    state.closed = True
    assert on_closed(state, A, NOW, LIVENESS).reopen


def test_closed_while_a_node_of_the_finished_job_is_alive_waits_for_it():
    state = state_with(a=2, b=100)
    state.closed = True
    decision = on_closed(state, C, NOW, LIVENESS)
    assert not decision.reopen
    assert decision.waiting_for == (A,)
    assert str(A) in decision.reason


def test_the_joining_node_own_heartbeat_does_not_keep_it_closed():
    state = state_with(a=1)
    state.closed = True
    assert on_closed(state, A, NOW, LIVENESS).reopen


def test_reopen_empties_the_state_and_moves_to_a_fresh_round():
    state = state_with(a=1, b=1)
    state.closed = True
    state.wait_list.add(C)
    reopen(state)
    assert (state.round, state.closed, state.complete) == (5, False, False)
    assert not state.participants and not state.wait_list and not state.last_heartbeats
    assert state.deadline is None and not state.redundancy_list


def test_members_all_alive_are_not_lost():
    state = state_with(a=1, b=3)
    assert lost_members(state, 4, {A, B}, C, NOW, LIVENESS) is None


def test_a_member_with_a_stale_heartbeat_is_lost():
    state = state_with(a=1, b=16)
    reason = lost_members(state, 4, {A, B}, C, NOW, LIVENESS)
    assert reason is not None and str(B) in reason and str(A) not in reason


def test_a_member_that_left_is_lost():
    state = state_with(a=1)
    reason = lost_members(state, 4, {A, B}, C, NOW, LIVENESS)
    assert reason is not None and str(B) in reason


def test_the_asking_node_is_never_lost_to_itself():
    state = state_with(a=30, b=1)
    assert lost_members(state, 4, {A, B}, A, NOW, LIVENESS) is None


def test_a_new_round_means_the_old_one_is_lost():
    state = state_with(a=1, b=1)
    state.round = 5
    reason = lost_members(state, 4, {A, B}, C, NOW, LIVENESS)
    assert reason is not None and "round 4 to round 5" in reason


def _leave_action(state: _RendezvousState, node: _NodeDesc, deadline: float = float("inf")) -> _Action:
    return LeaveOp()(_RendezvousContext(node, state, None), deadline)  # type: ignore[arg-type]


def test_leave_removes_the_node_from_whichever_list_holds_it():
    state = state_with(a=1)
    state.wait_list.add(B)
    state.redundancy_list.add(C)
    assert _leave_action(state, A) == _Action.REMOVE_FROM_PARTICIPANTS
    assert _leave_action(state, B) == _Action.REMOVE_FROM_WAIT_LIST
    assert _leave_action(state, C) == _Action.REMOVE_FROM_REDUNDANCY_LIST
    assert _leave_action(_RendezvousState(), A) == _Action.FINISH
    assert _leave_action(state, A, deadline=0) == _Action.ERROR_TIMEOUT


# Right after an etcd outage nobody could write a heartbeat: the handler passes
# liveness None, and no decision may count a node dead for its heartbeat's age.


def test_right_after_an_outage_a_stale_heartbeat_is_no_lost_member():
    state = state_with(a=1, b=40)
    assert lost_members(state, 4, {A, B}, C, NOW, None) is None
    del state.participants[B]  # a node that left is lost whatever the heartbeats say
    assert lost_members(state, 4, {A, B}, C, NOW, None) is not None


def test_right_after_an_outage_a_closed_rendezvous_with_stale_nodes_is_not_reopened():
    state = state_with(a=40, b=40)
    state.closed = True
    decision = on_closed(state, C, NOW, None)
    assert not decision.reopen and set(decision.waiting_for) == {A, B}


def test_a_lost_member_reads_with_its_reason():
    state = state_with(a=1, b=16)
    assert "keep-alive expired: last heartbeat 16 s ago" in lost_members(state, 4, {A, B}, C, NOW, LIVENESS)
    del state.participants[B]
    assert "left the round" in lost_members(state, 4, {A, B}, C, NOW, LIVENESS)


def test_with_last_seen_a_member_restarting_is_not_lost_and_a_dead_one_is():
    state = state_with(a=1)  # b left the participants (and its heartbeat with it)
    recent = {A: NOW, B: NOW - timedelta(seconds=2)}
    assert lost_members(state, 4, {A, B}, C, NOW, LIVENESS, recent) is None
    state.wait_list.add(B)  # rejoining, however long ago its last heartbeat
    assert lost_members(state, 4, {A, B}, C, NOW, LIVENESS, {B: NOW - timedelta(seconds=60)}) is None
    state.wait_list.clear()
    old = {B: NOW - timedelta(seconds=16)}
    assert "keep-alive expired: no heartbeat for 16 s" in lost_members(state, 4, {A, B}, C, NOW, LIVENESS, old)
    assert lost_members(state, 4, {A, B}, C, NOW, None, old) is None  # right after an outage: not judged
