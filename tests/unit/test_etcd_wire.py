"""The etcd messages described in elastic_ft/rendezvous/etcd/wire.py encode with etcd's field numbers,
and prefix ranges follow etcd's rule (pure logic; the real server is exercised in tests/rendezvous)."""

from __future__ import annotations

from elastic_ft.rendezvous.etcd import wire
from elastic_ft.rendezvous.etcd.kv import prefix_end


def test_prefix_end_increments_the_last_byte_below_0xff():
    assert prefix_end(b"elastic_ft/run/") == b"elastic_ft/run0"
    assert prefix_end(b"a\xff\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
    assert prefix_end(b"") == b"\0"


def test_compare_on_create_revision_zero_is_sent():
    # "Only if the key does not exist" compares create_revision with 0: in a
    # oneof, the zero must still be on the wire (field 5, varint 0).
    compare = wire.message("Compare", result=wire.COMPARE_EQUAL, target=wire.TARGET_CREATE, key=b"k",
                           create_revision=0)
    assert compare.SerializeToString() == b"\x10\x01\x1a\x01k\x28\x00"


def test_range_and_watch_fields_use_etcds_numbers():
    request = wire.message("RangeRequest", key=b"a", range_end=b"b", count_only=True)
    assert request.SerializeToString() == b"\x0a\x01a\x12\x01b\x48\x01"
    event = wire.message("Event", type=wire.EVENT_PUT, kv=wire.message("KeyValue", key=b"k", mod_revision=7))
    response = wire.messages()["WatchResponse"].FromString(
        wire.message("WatchResponse", events=[event]).SerializeToString()
    )
    assert response.events[0].kv.mod_revision == 7
    assert wire.message("WatchResponse", events=[event]).SerializeToString().startswith(b"\x5a")
