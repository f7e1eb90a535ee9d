"""The pure decisions of keep-alives as leases (elastic_ft.rendezvous.leased_heartbeats): what a reader
makes of the liveness keys, what a writer puts back, and which change is a heartbeat alone."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

from elastic_ft.rendezvous.leased_heartbeats import (
    alive_name, fingerprint, lease_ttl, only_own_heartbeat_changed, overlay_heartbeats, restore_stored,
)
from elastic_ft.rendezvous.torch_internals import RendezvousState

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
OLD = NOW - timedelta(minutes=10)


def state(*nodes: str) -> RendezvousState:
    s = RendezvousState()
    for rank, node in enumerate(nodes):
        s.participants[node] = rank
        s.last_heartbeats[node] = OLD
    return s


def test_a_node_with_a_liveness_key_is_alive_now_one_without_keeps_its_stored_heartbeat():
    s = state("me", "alive", "silent")
    refreshed = NOW - timedelta(seconds=1)
    overlay = overlay_heartbeats(s.last_heartbeats, {"me", "alive"}, "me", refreshed, NOW)
    assert s.last_heartbeats == {"me": refreshed, "alive": NOW, "silent": OLD}
    # The silent node is lapsed (judged on its stored heartbeat); this node never is.
    assert overlay.lapsed == {"silent": OLD}
    assert overlay.given == {"me": (refreshed, OLD), "alive": (NOW, OLD)}


def test_this_nodes_heartbeat_is_its_last_refresh_so_its_keep_alive_comes_due():
    s = state("me")
    overlay_heartbeats(s.last_heartbeats, {"me"}, "me", None, NOW)
    assert s.last_heartbeats["me"] == OLD  # never refreshed: as stored, so torch's keep-alive fires


def test_no_heartbeat_moves_back_and_no_node_is_added():
    s = state("other")
    s.last_heartbeats["other"] = NOW + timedelta(seconds=5)  # written by a node whose clock is ahead
    overlay_heartbeats(s.last_heartbeats, {"other", "stranger"}, "me", None, NOW)
    assert s.last_heartbeats == {"other": NOW + timedelta(seconds=5)}


def test_a_write_puts_back_the_stored_heartbeats_of_the_others_but_not_its_own():
    s = state("me", "a", "b")
    overlay = overlay_heartbeats(s.last_heartbeats, {"me", "a", "b"}, "me", NOW, NOW)
    s.last_heartbeats["b"] = NOW + timedelta(seconds=1)  # changed since (not what the overlay gave)
    restore_stored(s.last_heartbeats, overlay.given, "me")
    assert s.last_heartbeats == {"me": NOW, "a": OLD, "b": NOW + timedelta(seconds=1)}


def test_only_a_change_of_its_own_heartbeat_is_a_heartbeat():
    s = state("me", "a")
    synced = (fingerprint(s, "me"), s.last_heartbeats["me"])
    assert not only_own_heartbeat_changed(synced, s, "me")  # nothing changed
    s.last_heartbeats["me"] = NOW
    assert only_own_heartbeat_changed(synced, s, "me")
    assert not only_own_heartbeat_changed(None, s, "me")  # nothing synced yet
    for change in (
        lambda t: t.participants.pop("a"),  # e.g. torch's sanitizer dropped a dead node: it must be written
        lambda t: t.last_heartbeats.pop("a"),
        lambda t: t.wait_list.add("c"),
        lambda t: setattr(t, "complete", True),
        lambda t: setattr(t, "round", 1),
        lambda t: t.last_heartbeats.__setitem__("a", NOW),
    ):
        t = state("me", "a")
        t.last_heartbeats["me"] = NOW
        change(t)
        assert not only_own_heartbeat_changed(synced, t, "me")


def test_the_lease_ttl_is_torchs_keep_alive_expiry_rounded_up():
    def settings(interval: float, attempts: int) -> RendezvousSettings:
        return RendezvousSettings("r", 1, 1, RendezvousTimeout(), timedelta(seconds=interval), attempts)

    assert lease_ttl(settings(2, 3)) == 6
    assert lease_ttl(settings(1.5, 3)) == 5
    assert lease_ttl(settings(0.1, 1)) == 1
    assert alive_name("host_12_0") == "host_12_0"
