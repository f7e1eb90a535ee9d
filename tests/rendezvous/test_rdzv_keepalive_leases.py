"""Keep-alives are lease refreshes, not writes of the shared state (elastic_ft.rendezvous.leased_heartbeats).

Real etcd, real handlers (threads as nodes). In a steady state the rendezvous
state key is not rewritten by keep-alives while every node stays alive; a
silent node (its keep-alives stopped, as SIGSTOP does) is still lost within
the keep-alive expiry and the round re-forms without it; an etcd that stops
answering for less than the lease TTL, or for longer (its leases then expire
when it answers again), loses nobody.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ft.rendezvous.etcd import EtcdClient
from elastic_ft.rendezvous.handler import create_handler
from elastic_ft.rendezvous.options import parse_options
from elastic_ft.rendezvous.torch_internals import state_holder, stop_heartbeats, this_node
from etcd_server import EtcdServer
from threads import run_in_threads
from tests.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

INTERVAL_S = 1
ATTEMPTS = 3
EXPIRY_S = INTERVAL_S * ATTEMPTS


def make_handlers(endpoint: str, run_id: str, n: int, min_nodes: int | None = None, **conf: str) -> list:
    conf = dict(last_call_timeout="1", join_timeout="60", keep_alive_interval=str(INTERVAL_S),
                keep_alive_max_attempt=str(ATTEMPTS), **conf)
    return [create_handler(RendezvousParameters("etcd3", endpoint, run_id, min_nodes or n, n, **conf))
            for _ in range(n)]


def form_round(handlers: list) -> list:
    return run_in_threads(lambda i: handlers[i].next_rendezvous(), len(handlers))


def state_revision(endpoint: str, run_id: str) -> int:
    """The state key's mod revision, read as another program would."""
    client = EtcdClient(parse_options(endpoint, {}).connection, name=run_id + "-probe")
    try:
        current, _ = client.get(f"/elastic_ft/rendezvous/{run_id}/state")
        assert current is not None
        return current.mod_revision
    finally:
        client.close()


def close_all(handlers: list) -> None:
    for h in handlers:
        stop_heartbeats(h)
        h.etcd_client.close()


def test_a_steady_state_does_not_rewrite_the_state_key(etcd, run_id):
    """Over several keep-alive periods of 8 live nodes the state key keeps its revision (before: one
    compare-and-set per node per keep-alive, about 8 x 6 / 1.5 = 32 revisions here)."""
    n, periods = 8, 6
    handlers = make_handlers(etcd.endpoint, run_id, n)
    try:
        form_round(handlers)
        # From the round on: each node's first keep-alive creates its liveness key (another key).
        before = state_revision(etcd.endpoint, run_id)
        end = time.monotonic() + periods * INTERVAL_S
        checks, losses = 0, []
        while time.monotonic() < end:  # the window is the measurement; every node must stay live through it
            losses += [(checks, i) for i, h in enumerate(handlers) if h.num_nodes_waiting()]
            state = state_holder(handlers[checks % n]).state
            if len(state.participants) != n or set(state.last_heartbeats) != set(state.participants):
                losses.append((checks, "state"))
            checks += 1
            time.sleep(0.25)
        after = state_revision(etcd.endpoint, run_id)
        assert after - before <= 1, f"the state key was rewritten {after - before} times in {periods} periods"
        assert not losses, f"nodes counted lost in a steady state (check, node): {losses}"
        assert handlers[0].etcd_client.count_prefix(f"/elastic_ft/rendezvous/{run_id}/alive/") == n
    finally:
        close_all(handlers)


def test_a_silent_node_is_lost_within_the_expiry_and_the_round_re_forms_without_it(etcd, run_id):
    handlers = make_handlers(etcd.endpoint, run_id, 3, min_nodes=2)
    try:
        form_round(handlers)
        silent, survivors = handlers[2], handlers[:2]
        # Let every node refresh its lease at least once: the silent node then has a live key.
        alive = f"/elastic_ft/rendezvous/{run_id}/alive/"
        wait_until(lambda: survivors[0].etcd_client.count_prefix(alive) == 3, timeout=30,
                   what="every node's liveness key")
        stop_heartbeats(silent)  # SIGSTOP: no more keep-alives, no more reads
        silenced = time.monotonic()
        assert [h.num_nodes_waiting() for h in survivors] == [0, 0]
        wait_until(lambda: all(h.num_nodes_waiting() == 1 for h in survivors), timeout=30,
                   what="both survivors to count the silent node lost", interval=0.1)
        lost_after = time.monotonic() - silenced
        # Its lease expires at most the TTL (the expiry) after its last refresh, which came before the
        # stop; plus etcd's expiry check (0.5 s), the state cache (1 s) and polling on a loaded host.
        assert lost_after <= EXPIRY_S + 2.5, f"lost only {lost_after:.1f} s after going silent"
        infos = run_in_threads(lambda i: survivors[i].next_rendezvous(), 2)
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
        state = state_holder(survivors[0]).state
        assert this_node(silent) not in state.participants
        assert set(state.participants) == {this_node(h) for h in survivors}
    finally:
        close_all(handlers)


@pytest.mark.parametrize("pause_s", [EXPIRY_S - 2, 3 * EXPIRY_S], ids=["shorter-than-ttl", "longer-than-ttl"])
def test_an_etcd_that_stops_answering_loses_no_node(tmp_path, run_id, pause_s):
    """etcd frozen (SIGSTOP: running, answering nobody, as behind a network partition) for
    ``pause_s``; a pause longer than the TTL expires every liveness lease once etcd runs again.
    Either way no node is counted lost, and every node's liveness key is back within the outage
    grace (the agents' requests time out after 1 s: they see the outage)."""
    server = EtcdServer(tmp_path / "etcd-data").start()
    n = 3
    handlers = make_handlers(server.endpoint, run_id, n, retry_timeout="60", request_timeout="1")
    alive = f"/elastic_ft/rendezvous/{run_id}/alive/"
    try:
        form_round(handlers)
        wait_until(lambda: handlers[0].etcd_client.count_prefix(alive) == n, timeout=30,
                   what="every node's liveness key")
        watching, seen_lost = True, []

        def watch() -> None:  # what torch's agents do: num_nodes_waiting every monitor interval
            while watching:
                seen_lost.extend(w for w in (h.num_nodes_waiting() for h in handlers) if w)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                time.sleep(pause_s)  # the fault injected: etcd answers nobody for this long
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            wait_until(lambda: handlers[0].etcd_client.count_prefix(alive) == n, timeout=60,
                       what="every node's liveness key after the pause")
            grace = timedelta(seconds=min(30, pause_s) + EXPIRY_S + 3).total_seconds()
            end = time.monotonic() + grace  # past the outage grace: stale heartbeats count again
            while time.monotonic() < end and not seen_lost:
                time.sleep(0.2)
        finally:
            watching = False
            watcher.join()
        assert not seen_lost, "a node was counted lost across the pause"
        for h in handlers:
            assert len(state_holder(h).state.participants) == n
    finally:
        close_all(handlers)
        server.stop()


def test_the_state_key_outlives_its_lease_ttl_while_nodes_send_keep_alives(etcd, run_id):
    """The state key lives on the lease of its last writer; with no more writes in a steady state,
    the nodes' keep-alives keep that lease alive: the key is neither lost nor written back."""
    ttl = 4
    handlers = make_handlers(etcd.endpoint, run_id, 2, lease_ttl=str(ttl))
    try:
        form_round(handlers)
        before = state_revision(etcd.endpoint, run_id)
        end = time.monotonic() + 3 * ttl
        while time.monotonic() < end:  # the window is the measurement: three of the state lease's TTLs
            assert state_revision(etcd.endpoint, run_id) == before  # (fails if the key is gone)
            assert [h.num_nodes_waiting() for h in handlers] == [0, 0]
            time.sleep(0.5)
        # Each node's own client lease (its round's store keys) is kept alive by its keep-alives too, as
        # its writes kept it before keep-alives were leases.
        for h in handlers:
            lease = h.etcd_client.lease_id
            assert lease is not None and h.etcd_client.lease_remaining_ttl(lease) > 0, lease
    finally:
        close_all(handlers)
