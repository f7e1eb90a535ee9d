"""The decisions that let a rendezvous ride out an etcd outage (elastic_ft.rendezvous.outage)."""

from datetime import timedelta

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_ft.rendezvous.etcd import Outage
from elastic_ft.rendezvous.outage import heartbeats_may_expire, lost_running_state

EXPIRY = timedelta(seconds=3)
GRACE = timedelta(seconds=30)


def test_heartbeats_expire_as_in_torch_without_an_outage():
    assert heartbeats_may_expire(None, now=1000.0, expiry=EXPIRY, grace=GRACE)


def test_no_node_is_dropped_until_the_grace_after_an_outage_ends():
    outage = Outage(started=1000.0, ended=1090.0)
    assert not heartbeats_may_expire(outage, now=1090.1, expiry=EXPIRY, grace=GRACE)
    # Grace (30 s, less than the outage) plus the heartbeat expiry (3 s).
    assert not heartbeats_may_expire(outage, now=1122.9, expiry=EXPIRY, grace=GRACE)
    assert heartbeats_may_expire(outage, now=1123.0, expiry=EXPIRY, grace=GRACE)


def test_a_short_blip_delays_dead_node_detection_only_by_its_length():
    outage = Outage(started=1000.0, ended=1000.5)
    assert not heartbeats_may_expire(outage, now=1003.9, expiry=EXPIRY, grace=GRACE)
    assert heartbeats_may_expire(outage, now=1004.0, expiry=EXPIRY, grace=GRACE)


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


def test_the_state_holder_says_heartbeats_do_not_count_right_after_an_outage():
    """The one answer the holder's dropping of dead nodes and the handler's checks share."""
    import time

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

    from elastic_ft.rendezvous.outage import OutageTolerantStateHolder

    settings = RendezvousSettings("run", 1, 2, RendezvousTimeout(), timedelta(seconds=5), 3)
    outage: list = [None]
    holder = OutageTolerantStateHolder(None, settings, lambda: outage[0])  # type: ignore[arg-type]
    assert holder.heartbeats_count()
    now = time.time()
    outage[0] = Outage(now - 20, now - 1)
    assert not holder.heartbeats_count()
    outage[0] = Outage(now - 100, now - 60)
    assert holder.heartbeats_count()
