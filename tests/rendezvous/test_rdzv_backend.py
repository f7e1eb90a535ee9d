"""Contract tests of the etcd v3 RendezvousBackend against a real etcd process.

The cases torch's own backend tests cover: first write, stale token (a
token that is no revision is stale too), concurrent writers, TTL expiry,
connection loss, a corrupt value in etcd; plus recovery from an etcd restart
through the client's retries, and the state's authentication: a value written
with another key, tampered, truncated or a raw pickle is refused, never unpickled.
"""

from __future__ import annotations

import base64
import pickle
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from elastic_ft.rendezvous.backend import EtcdV3RendezvousBackend
from elastic_ft.rendezvous.etcd import EtcdClient
from elastic_ft.rendezvous.options import parse_options
from elastic_ft.rendezvous import state_codec
from elastic_ft.rendezvous.state_codec import KEY_ENV, StateCodec, StateSecret

JOB_KEY = StateSecret("the job's rendezvous key, 32 chars", KEY_ENV)
from tests.waiting import wait_until


def make_backend(
    endpoint: str, run_id: str, secret: StateSecret | None = None, **conf: str
) -> EtcdV3RendezvousBackend:
    """A backend as torch's contract tests use it: a plain etcd, no key (unless ``secret``)."""
    options = parse_options(endpoint, conf, environ={})
    client = EtcdClient(options.connection, name=run_id)
    return EtcdV3RendezvousBackend(client, run_id, options.run_prefix(run_id), secret=secret)


def raw_client(endpoint: str, run_id: str) -> EtcdClient:
    """A client of our own, to read and damage the stored value as another program would."""
    return EtcdClient(parse_options(endpoint, {}).connection, name=run_id + "-raw")


def test_get_state_is_none_before_first_write(etcd, run_id):
    assert make_backend(etcd.endpoint, run_id).get_state() is None


def test_first_write_without_token_creates_the_state(etcd, run_id):
    backend = make_backend(etcd.endpoint, run_id)
    state, token, written = backend.set_state(b"first")
    assert (state, written) == (b"first", True)
    assert backend.get_state() == (b"first", token)


def test_second_write_without_token_returns_existing_state(etcd, run_id):
    a = make_backend(etcd.endpoint, run_id)
    b = make_backend(etcd.endpoint, run_id)
    _, token, _ = a.set_state(b"from a")
    assert b.set_state(b"from b") == (b"from a", token, False)


def test_write_with_current_token_succeeds_and_changes_token(etcd, run_id):
    backend = make_backend(etcd.endpoint, run_id)
    _, token1, _ = backend.set_state(b"v1")
    state, token2, written = backend.set_state(b"v2", token1)
    assert (state, written) == (b"v2", True)
    assert token2 != token1


def test_stale_token_returns_current_state_and_false(etcd, run_id):
    a = make_backend(etcd.endpoint, run_id)
    b = make_backend(etcd.endpoint, run_id)
    _, stale, _ = a.set_state(b"v1")
    _, current, _ = b.set_state(b"v2", stale)
    assert a.set_state(b"v3", stale) == (b"v2", current, False)
    assert a.get_state() == (b"v2", current)


def test_concurrent_writers_exactly_one_wins(etcd, run_id):
    writers = [make_backend(etcd.endpoint, run_id) for _ in range(8)]
    _, token, _ = writers[0].set_state(b"base")
    barrier = threading.Barrier(len(writers))
    results: list = [None] * len(writers)

    def write(i: int) -> None:
        barrier.wait()
        results[i] = writers[i].set_state(f"writer {i}".encode(), token)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r[2]]
    assert len(winners) == 1
    won_state, won_token, _ = winners[0]
    # Every loser is handed the winner's state to merge with.
    assert all((s, t) == (won_state, won_token) for s, t, _ in results)


def test_concurrent_first_writers_exactly_one_creates(etcd, run_id):
    writers = [make_backend(etcd.endpoint, run_id) for _ in range(6)]
    barrier = threading.Barrier(len(writers))
    results: list = [None] * len(writers)

    def write(i: int) -> None:
        barrier.wait()
        results[i] = writers[i].set_state(f"creator {i}".encode())

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r[2] for r in results) == 1
    assert len({(r[0], r[1]) for r in results}) == 1


def test_runs_do_not_share_state(etcd, run_id):
    make_backend(etcd.endpoint, run_id + "-a").set_state(b"a")
    assert make_backend(etcd.endpoint, run_id + "-b").get_state() is None


def test_state_expires_after_lease_ttl_without_writes(etcd, run_id):
    backend = make_backend(etcd.endpoint, run_id, lease_ttl="2")
    backend.set_state(b"abandoned")
    wait_until(lambda: backend.get_state() is None, timeout=30, what="the abandoned state to expire")


def test_writes_keep_the_state_alive(etcd, run_id):
    # Refreshing at a quarter of the TTL keeps the key while an agent heartbeats.
    backend = make_backend(etcd.endpoint, run_id, lease_ttl="2")
    _, token, _ = backend.set_state(b"alive")
    lease_id = backend._client.lease_id
    end = time.monotonic() + 4
    while time.monotonic() < end:
        _, token, written = backend.set_state(b"alive", token)
        assert written
        time.sleep(0.3)  # the agent's heartbeat interval, scaled down
    assert backend.get_state() is not None
    assert backend._client.lease_remaining_ttl(lease_id) > 0


def test_state_written_after_lease_expired_gets_a_new_lease(etcd, run_id):
    backend = make_backend(etcd.endpoint, run_id, lease_ttl="2")
    backend.set_state(b"v1")
    old_lease = backend._client.lease_id
    wait_until(lambda: backend.get_state() is None, timeout=30, what="the state to expire")
    # The old lease is gone; the next write must still succeed.
    state, _, written = backend.set_state(b"v2")
    assert (state, written) == (b"v2", True)
    assert backend._client.lease_id != old_lease


@pytest.mark.parametrize(
    "token",
    ["not-a-number", object(), -1, 2**64, True, b"\xff"],
    ids=["text", "object", "negative", "past-int64", "bool", "bytes"],
)
def test_token_that_is_not_a_revision_is_stale(etcd, run_id, token):
    # As torch's backends: the current state and token, and False; nothing written.
    a = make_backend(etcd.endpoint, run_id)
    assert a.set_state(b"first", token) is None  # no state yet
    _, current, _ = a.set_state(b"v1")
    b = make_backend(etcd.endpoint, run_id)
    assert b.set_state(b"v2", token) == (b"v1", current, False)
    assert a.get_state() == (b"v1", current)


@pytest.mark.parametrize("secret", [None, JOB_KEY], ids=["no-key", "key"])
def test_state_is_stored_authenticated_not_raw(etcd, run_id, secret):
    backend = make_backend(etcd.endpoint, run_id, secret)
    state = pickle.dumps({"round": 3, "participants": ["node-a"]})
    backend.set_state(state)
    stored = raw_client(etcd.endpoint, run_id).get(backend.key)[0].value
    assert stored.startswith(b"eft-state/2:" + backend.codec.key_id + b":")
    assert state not in stored
    assert make_backend(etcd.endpoint, run_id, secret).get_state()[0] == state


class _Payload:
    """Unpickling this touches ``path``: proof that a value was loaded."""

    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        self.path = str(path)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _refused_values(encoded: bytes, payload: bytes, forged: dict[str, bytes]) -> dict[str, bytes]:
    """Values an etcd writer (or damage) can leave in the key, keyed by a readable name."""
    header, body = encoded.rsplit(b":", 1)
    return {
        "truncated-body": header + b":" + body[:-4],  # still valid base64
        "altered-body": header + b":" + (b"A" if body[:1] != b"A" else b"B") + body[1:],
        "not-base64": header + b":" + body[:-2] + b"!!",
        "no-tag": b"eft-state/2:" + body,
        "raw-text": b"hello, not a state",
        "raw-pickle": payload,
        "truncated-raw-pickle": payload[:-1],
        "older-format": b"eft-state/1:0123456789abcdef:" + base64.b64encode(payload),
        "empty": b"",
        **forged,
    }


def _forged(run_id: str, key: str, payload: bytes) -> dict[str, bytes]:
    """The payload in our envelope, written by someone without the job's key."""
    return {
        "other-key": StateCodec(StateSecret("another job's key, 32 characters", KEY_ENV), key).encode(payload),
        "other-run": StateCodec(JOB_KEY, key.replace(run_id, run_id + "-other")).encode(payload),
        "no-key": StateCodec(None, key).encode(payload),
    }


@pytest.mark.parametrize("damage", [
    "truncated-body", "altered-body", "not-base64", "no-tag", "raw-text", "raw-pickle", "truncated-raw-pickle",
    "older-format", "empty", "other-key", "other-run", "no-key",
])
def test_unverified_state_is_refused_naming_the_key_and_never_unpickled(
    etcd, run_id, damage, tmp_path, monkeypatch
):
    backend = make_backend(etcd.endpoint, run_id, JOB_KEY)
    _, token, _ = backend.set_state(pickle.dumps({"round": 1, "nodes": list(range(20))}))
    raw = raw_client(etcd.endpoint, run_id)
    payload = pickle.dumps(_Payload(tmp_path / "loaded"))
    values = _refused_values(raw.get(backend.key)[0].value, payload, _forged(run_id, backend.key, payload))
    raw.put_many([(backend.key, values[damage])], lease=False)

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the refused state was unpickled")

    monkeypatch.setattr(pickle, "loads", never)
    monkeypatch.setattr(state_codec, "check_state_types", never)
    with pytest.raises(RendezvousStateError) as info:
        backend.get_state()
    message = str(info.value)
    assert f"etcd key '{backend.key}' is refused" in message and "\n" not in message
    # A writer with the old token loses and is handed the refused state: refused too.
    with pytest.raises(RendezvousStateError, match="is refused"):
        make_backend(etcd.endpoint, run_id, JOB_KEY).set_state(b"next", token)
    assert not (tmp_path / "loaded").exists()


def test_state_without_a_key_may_name_only_the_rendezvous_state_types(etcd, run_id, tmp_path):
    """A plain etcd, no key: whoever can write it can forge the envelope, so the pickle's
    globals are checked before torch would load it."""
    backend = make_backend(etcd.endpoint, run_id)
    forged = StateCodec(None, backend.key).encode(pickle.dumps(_Payload(tmp_path / "loaded")))
    raw_client(etcd.endpoint, run_id).put_many([(backend.key, forged)], lease=False)
    with pytest.raises(RendezvousStateError, match=r"is refused: its pickle names builtins\.exec"):
        backend.get_state()
    assert not (tmp_path / "loaded").exists()


def test_agents_with_different_keys_refuse_each_others_state(etcd, run_id):
    mine = make_backend(etcd.endpoint, run_id, JOB_KEY)
    mine.set_state(b"v1")
    other = make_backend(etcd.endpoint, run_id, StateSecret("a different key, 32 characters.", KEY_ENV))
    with pytest.raises(RendezvousStateError, match="written with another key .* every agent of the run"):
        other.get_state()
    with pytest.raises(RendezvousStateError, match="written with a key .* this agent has none"):
        make_backend(etcd.endpoint, run_id).get_state()


def test_connection_loss_raises_connection_error_naming_endpoint(etcd_private, run_id):
    backend = make_backend(etcd_private.endpoint, run_id, retry_timeout="1")
    backend.set_state(b"before")
    etcd_private.stop()
    with pytest.raises(RendezvousConnectionError, match=etcd_private.endpoint) as info:
        backend.get_state()
    assert info.value.__cause__ is not None
    with pytest.raises(RendezvousConnectionError, match=etcd_private.endpoint):
        backend.set_state(b"during", 1)


def test_state_survives_etcd_restart_and_client_recovers(etcd_private, run_id):
    backend = make_backend(etcd_private.endpoint, run_id)
    _, token, _ = backend.set_state(b"kept")
    etcd_private.stop()
    # Restart in the background while get_state is retrying.
    restarter = threading.Thread(target=etcd_private.start)
    restarter.start()
    try:
        assert backend.get_state() == (b"kept", token)
    finally:
        restarter.join()
    assert backend.set_state(b"next", token)[2]


def test_failover_to_the_next_endpoint(etcd, run_id):
    from etcd_server import free_port

    dead = f"127.0.0.1:{free_port()}"
    backend = make_backend(f"{dead},{etcd.endpoint}", run_id, retry_timeout="20")
    state, _, written = backend.set_state(b"via failover")
    assert (state, written) == (b"via failover", True)
    assert backend._client.endpoint.port == etcd.client_port


def test_run_id_with_slash_is_rejected(etcd):
    with pytest.raises(ValueError, match="must not contain '/'"):
        make_backend(etcd.endpoint, "a/b")
