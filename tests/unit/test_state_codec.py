"""The rendezvous state codec: authenticated with the job's key, refused before any unpickling unless it verifies.

Pure logic (no etcd): the backend's tests on a real etcd are in tests/rendezvous/test_rdzv_backend.py.
"""

from __future__ import annotations

import pickle
import struct
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_ft.rendezvous import state_codec
from elastic_ft.rendezvous.state_codec import KEY_ENV, StateCodec, StateSecret, state_secret

KEY = "/elastic_ft/rendezvous/run-1/state"
SECRET = StateSecret("0123456789abcdef0123456789abcdef", KEY_ENV)


def torch_state() -> bytes:
    """A state as torch's handler pickles it, with every field filled."""
    state = _RendezvousState()
    a, b = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 12, 0)
    state.round = 4
    state.complete = True
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=30)
    state.participants = {a: 0, b: 1}
    state.wait_list = {b}
    state.redundancy_list = {a}
    state.last_heartbeats = {a: datetime.now(timezone.utc), b: datetime.utcnow()}
    return pickle.dumps(state)


class Runs:
    """Unpickling this sets ``builtins._eft_codec_ran``: proof that code ran (see :func:`ran`)."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, ("import builtins; builtins._eft_codec_ran = True",))


def ran() -> bool:
    import builtins

    return getattr(builtins, "_eft_codec_ran", False)


def _short(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()  # SHORT_BINUNICODE


def stack_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that resolves ``module.name`` (dotted names allowed) and calls it with ()."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + b")R."  # STACK_GLOBAL, EMPTY_TUPLE, REDUCE, STOP


@pytest.mark.parametrize("secret", [SECRET, None], ids=["key", "no-key"])
def test_torch_state_round_trips(secret):
    codec = StateCodec(secret, KEY)
    state = torch_state()
    value = codec.encode(state)
    assert value.startswith(b"eft-state/2:") and state not in value
    assert StateCodec(secret, KEY).decode(value) == state


def test_the_key_is_bound_to_the_secret_and_the_etcd_key():
    ids = {
        StateCodec(SECRET, KEY).key_id,
        StateCodec(StateSecret("another secret of 32 characters.", KEY_ENV), KEY).key_id,
        StateCodec(SECRET, KEY.replace("run-1", "run-2")).key_id,
    }
    assert len(ids) == 3 and b"none" not in ids
    assert StateCodec(SECRET, KEY).key_id == StateCodec(SECRET, KEY).key_id
    assert StateCodec(None, KEY).key_id == b"none"
    # The key id is no hash of the secret that would test a guess cheaply without the KDF.
    assert SECRET.value.encode() not in StateCodec(SECRET, KEY).encode(b"x")


def test_a_value_from_another_run_with_the_same_secret_is_refused():
    """A state copied from one run's key into another's does not verify (the etcd key salts the key)."""
    other = StateCodec(SECRET, KEY.replace("run-1", "run-2")).encode(torch_state())
    with pytest.raises(RendezvousStateError, match="written with another key"):
        StateCodec(SECRET, KEY).decode(other)


def _refusals(codec: StateCodec) -> dict[str, bytes]:
    payload = pickle.dumps(Runs())
    good = codec.encode(payload)
    head, _, body = good.rpartition(b":")
    flipped = bytearray(good)
    flipped[len(head) - 1] ^= 1  # the tag's last hex digit
    return {
        "raw-pickle": payload,
        "raw-pickle-protocol-0": pickle.dumps(Runs(), protocol=0),
        "older-format": b"eft-state/1:0123456789abcdef:" + body,
        "truncated": good[:-8],
        "tag-flipped": bytes(flipped),
        "body-swapped": head + b":" + codec.encode(torch_state()).rpartition(b":")[2],
        "other-key": StateCodec(StateSecret("an attacker's key, 32 characters", KEY_ENV), KEY).encode(payload),
        "no-key": StateCodec(None, KEY).encode(payload),
        "header-only": b"eft-state/2:",
        "multi-line-key-id": b"eft-state/2:ab\ncd\n:" + good.split(b":", 2)[2],
    }


@pytest.mark.parametrize("case", list(_refusals(StateCodec(SECRET, KEY))))
def test_refused_values_are_never_unpickled(case, monkeypatch):
    codec = StateCodec(SECRET, KEY)
    value = _refusals(codec)[case]

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("unpickled a refused value")

    monkeypatch.setattr(pickle, "loads", never)
    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(state_codec._StateUnpickler, "load", never)
    with pytest.raises(RendezvousStateError) as info:
        codec.decode(value)
    message = str(info.value)
    assert f"The rendezvous state in the etcd key '{KEY}' is refused: " in message
    assert "\n" not in message and f"etcdctl del '{KEY}'" in message
    assert not ran()


@pytest.mark.parametrize("gadget", [
    pickle.dumps(Runs()),
    stack_global("os", "getcwd"),
    stack_global("builtins", "eval"),
    # A dotted name reaches attributes through an allowed class: refused too (exact names only).
    stack_global("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState.__init__"),
    stack_global("datetime", "datetime.now"),
    stack_global("os\nline two", "system"),
    b"\x80\x02cposix\nsystem\n" + _short("true") + b"\x85R.",  # GLOBAL opcode, protocol 2
], ids=["exec", "os.getcwd", "eval", "dotted-state-attr", "dotted-datetime", "multi-line-name",
         "protocol-2-global"])
def test_without_a_key_a_pickle_naming_other_globals_is_refused_before_torch_loads_it(gadget):
    codec = StateCodec(None, KEY)
    with pytest.raises(RendezvousStateError, match=f"etcd key '{KEY}' is refused: its pickle names ") as info:
        codec.decode(codec.encode(gadget))
    assert "\n" not in str(info.value)
    assert not ran()


def test_without_a_key_bytes_that_are_no_pickle_pass_as_torch_contract_tests_write_them():
    codec = StateCodec(None, KEY)
    for state in (b"first", b"", struct.pack("<q", 7)):
        assert codec.decode(codec.encode(state)) == state


def test_state_secret_prefers_the_key_variable_and_bounds_it():
    assert state_secret({KEY_ENV: "k" * 16}, "pw") == StateSecret("k" * 16, KEY_ENV)
    assert state_secret({}, "pw") == StateSecret("pw", "the etcd password")
    assert state_secret({}, None) is None and state_secret({}, "") is None
    for bad in ("k" * 15, "k" * 4097, ""):
        with pytest.raises(ValueError, match=f"^{KEY_ENV}: the rendezvous key must have 16 to 4096") as info:
            state_secret({KEY_ENV: bad}, "pw")
        assert bad not in str(info.value) or not bad
    assert "k" * 16 not in repr(state_secret({KEY_ENV: "k" * 16}, None))
