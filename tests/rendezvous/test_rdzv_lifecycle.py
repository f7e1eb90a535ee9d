"""The rendezvous of a run id across jobs and lost nodes, handlers in this process, real etcd.

A closed rendezvous is for a completed job only; a new submission reopens it;
a wait for a lost node's keys ends within seconds and the round starts again.
The same with torchrun agents is in test_rdzv_resubmit.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from elastic_ft.rendezvous.handler import create_handler

from agents import rendezvous_state_of
from threads import run_in_threads


def handler(endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 1, **conf: str):
    # A node is dead 3 s after its last heartbeat (1 s apart): torch's ratio, 5 s and 15 s.
    conf = {"last_call_timeout": "1", "join_timeout": "30", "keep_alive_interval": "1",
            "keep_alive_max_attempt": "3", **conf}
    return create_handler(RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf))


def state_of(h):  # type: ignore[no-untyped-def]
    """The rendezvous state in etcd now (torch's own pickled state)."""
    state = rendezvous_state_of(h._state_holder._backend)
    assert state is not None
    return state


def fail_like_torchrun(h) -> None:  # type: ignore[no-untyped-def]
    """What torch's launcher does when the agent's run raises: shutdown() from a finally."""
    with pytest.raises(RuntimeError, match="workers failed"):
        try:
            raise RuntimeError("workers failed past --max-restarts")
        finally:
            h.shutdown()


def test_a_failing_agent_leaves_the_rendezvous_open_and_a_new_agent_joins(etcd, run_id):
    first = handler(etcd.endpoint, run_id)
    first.next_rendezvous()
    fail_like_torchrun(first)
    state = state_of(first)
    assert not state.closed
    assert not state.participants  # it left; nobody waits for its heartbeat to expire

    again = handler(etcd.endpoint, run_id)
    info = again.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    again.shutdown()


def test_a_completed_job_closes_and_a_new_submission_reopens_at_a_fresh_round(etcd, run_id):
    first = handler(etcd.endpoint, run_id)
    info = first.next_rendezvous()
    info.store.set("left-by-the-first-job", b"1")
    first.shutdown()  # success: no exception in flight
    closed = state_of(first)
    assert closed.closed and not closed.last_heartbeats

    again = handler(etcd.endpoint, run_id)
    info = again.next_rendezvous()
    state = state_of(again)
    assert not state.closed and state.round == closed.round + 1
    assert (info.rank, info.world_size) == (0, 1)
    # The new round's store is empty: torch prefixes the agents' keys with the round.
    assert not info.store.check(["left-by-the-first-job"])
    again.shutdown()


def test_a_closed_rendezvous_whose_job_is_still_exiting_is_not_reopened(etcd, run_id):
    # b's heartbeat (every 1 s) counts as alive for 5 s: a margin for a busy machine.
    a, b = (handler(etcd.endpoint, run_id, 2, 2, keep_alive_max_attempt="5") for _ in range(2))
    run_in_threads(lambda i: (a, b)[i].next_rendezvous(), 2)
    a.shutdown()  # b's agent is still in its exit barrier, heartbeating
    late = handler(etcd.endpoint, run_id, join_timeout="3", keep_alive_max_attempt="5")
    with pytest.raises(RendezvousClosedError, match="still exiting.*Submit again once they have exited"):
        late.next_rendezvous()
    b.shutdown()
    after = handler(etcd.endpoint, run_id)
    assert after.next_rendezvous().world_size == 1
    after.shutdown()


def test_a_wait_for_a_lost_nodes_key_ends_within_seconds(etcd, run_id):
    a, b = handler(etcd.endpoint, run_id, 2, 2), handler(etcd.endpoint, run_id, 2, 2)
    infos = run_in_threads(lambda i: (a, b)[i].next_rendezvous(), 2)
    b._stop_heartbeats()  # b's machine is gone: no heartbeat, no goodbye
    # The old store waited its full timeout (300 s by default) for a lost node.
    a._store.set_timeout(timedelta(seconds=60))
    other = 1 - infos[0].rank
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="stopped waiting") as error:
        infos[0].store.get(f"torchelastic/role_info/{other}")
    # Well under the 60 s store timeout set above, so not that timeout; loose
    # enough for a busy machine (the heartbeat expiry is 3 s).
    assert time.monotonic() - started < 40
    assert str(b._this_node) in str(error.value)
    a.shutdown()


def test_a_node_lost_before_all_met_makes_a_new_round_without_it(etcd, run_id):
    a = handler(etcd.endpoint, run_id, 1, 2, last_call_timeout="3")
    b = handler(etcd.endpoint, run_id, 1, 2, last_call_timeout="3")
    both_joined = threading.Event()

    def lost_node() -> None:
        # b completes the round as torch does, then its machine is lost
        # before its agent gets further (no meeting, no heartbeat).
        info = DynamicRendezvousHandler.next_rendezvous(b)
        assert info.world_size == 2
        both_joined.set()
        b._stop_heartbeats()

    results = run_in_threads(lambda i: a.next_rendezvous() if i == 0 else lost_node(), 2)
    assert both_joined.is_set()
    info = results[0]
    assert (info.rank, info.world_size) == (0, 1)
    assert list(state_of(a).participants) == [a._this_node]
    a.shutdown()
