"""The decisions that let a rendezvous ride out an etcd outage (elastic_ft.rendezvous.outage)."""

from datetime import timedelta

import pytest

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_ft.rendezvous.etcd_client import Outage
from elastic_ft.rendezvous.outage import heartbeat_expiry, lost_running_state

EXPIRY = timedelta(seconds=3)
GRACE = timedelta(seconds=30)


def test_heartbeat_expiry_is_torchs_without_an_outage():
    assert heartbeat_expiry(None, now=1000.0, expiry=EXPIRY, grace=GRACE) == EXPIRY


def test_heartbeats_fresh_when_etcd_went_away_count_until_the_grace_ends():
    outage = Outage(started=1000.0, ended=1090.0)
    # Right after etcd answers: a heartbeat from up to the grace before the outage still counts.
    assert heartbeat_expiry(outage, now=1091.0, expiry=EXPIRY, grace=GRACE) == timedelta(seconds=124)
    # Near the end of the while the allowance still covers the whole span since the outage began.
    assert heartbeat_expiry(outage, now=1122.0, expiry=EXPIRY, grace=GRACE) == timedelta(seconds=155)
    # After grace + expiry, nodes that sent no heartbeat since etcd returned are dead again.
    assert heartbeat_expiry(outage, now=1123.0, expiry=EXPIRY, grace=GRACE) == EXPIRY


def test_a_short_blip_delays_dead_node_detection_only_by_its_length():
    outage = Outage(started=1000.0, ended=1000.5)
    allowed = heartbeat_expiry(outage, now=1000.6, expiry=EXPIRY, grace=GRACE)
    assert allowed.total_seconds() == pytest.approx(4.1)
    assert heartbeat_expiry(outage, now=1004.0, expiry=EXPIRY, grace=GRACE) == EXPIRY


def running_state(**changes) -> _RendezvousState:
    state = _RendezvousState()
    state.complete = True
    state.participants = {_NodeDesc("host", 1, 0): 0}
    for name, value in changes.items():
        setattr(state, name, value)
    return state


def test_lost_state_is_restored_only_for_a_running_open_round():
    assert lost_running_state(running_state(), key_exists=False)
    assert not lost_running_state(running_state(), key_exists=True)
    assert not lost_running_state(running_state(closed=True), key_exists=False)
    assert not lost_running_state(running_state(complete=False), key_exists=False)
    assert not lost_running_state(running_state(participants={}), key_exists=False)
    assert not lost_running_state(_RendezvousState(), key_exists=False)
