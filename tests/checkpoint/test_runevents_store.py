"""The run's events in a real store (filesystem, moto, SeaweedFS): attempt claims, shipments, the save's hook."""

from __future__ import annotations

import json
import threading

import pytest

from elastic_ft.checkpoint.reader import list_manifests
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.save_errors import SaveFailed
from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot
from elastic_ft.runevents.events import EventLog
from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.runevents.layout import claim_attempt, claim_attempt_retrying, claimed_attempts
from elastic_ft.runevents.load import read_store_events
from elastic_ft.runevents.shipper import Shipper

try:
    from .s3_servers import make_s3_store
except ImportError:
    from s3_servers import make_s3_store


def test_attempt_claims_are_unique_and_increasing(backend):
    store = backend.store
    assert claim_attempt(store) == 1
    assert claim_attempt(store) == 2
    # A leader whose own events.jsonl counts further (a machine that led before) starts there.
    assert claim_attempt(store, at_least=5) == 5
    # One that counts less (a new machine: its file is empty) still goes past every claim in the store.
    assert claim_attempt(store, at_least=1) == 6
    # Leaders racing for the same numbers each get their own.
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(claim_attempt(store, at_least=7))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [7, 8, 9, 10]
    assert claimed_attempts(store) == [1, 2, 5, 6, 7, 8, 9, 10]


@pytest.fixture
def proxied_s3(s3_servers, s3_env, fault_proxy):
    """``(store, proxy)``: an S3 store on moto whose requests pass the fault proxy."""
    endpoint = s3_servers.get("moto")
    proxy = fault_proxy(endpoint)
    s3_env(endpoint, endpoint_url=proxy.url)
    store, _ = make_s3_store(endpoint)
    try:
        yield store, proxy
    finally:
        store.close()


def test_s3_a_claim_whose_reply_was_lost_is_ours(proxied_s3):
    store, proxy = proxied_s3
    # The claim's PUT lands and its reply is lost: the store's retry finds the key taken (412) by our token.
    proxy.add("drop_after", method="PUT", path=r"/events/attempts/", times=1)
    assert claim_attempt(store) == 1
    assert claimed_attempts(store) == [1] and any(s.fault == "drop_after" for s in proxy.seen)
    assert claim_attempt(store) == 2


def test_s3_the_claim_at_a_workers_start_outlasts_the_stores_own_retries(proxied_s3, caplog):
    """The store gives up after its 4 attempts (make_s3_store's max_attempts) twice in a row; the claim
    tries again, logs each failed try, and gets its number; past its tries it says how many."""
    store, proxy = proxied_s3
    proxy.add("slowdown", method="PUT", path=r"/events/attempts/", times=4)
    with pytest.raises(StoreError, match="failed after 4 attempts"):  # the store's own retries alone
        claim_attempt(store)
    proxy.add("slowdown", method="PUT", path=r"/events/attempts/", times=2 * 4)
    assert claim_attempt_retrying(store, tries=3, backoff_s=0.01) == 1
    assert claimed_attempts(store) == [1]
    assert [r.getMessage().split(" failed")[0] for r in caplog.records if "try " in r.getMessage()] == \
        [f"claiming the attempt number in {store.join('events/attempts/')}: try {n} of 3" for n in (1, 2)]
    proxy.add("slowdown", method="PUT", path=r"/events/attempts/", times=100)
    with pytest.raises(StoreError, match=r"^the attempt number not claimed after 2 tries: "):
        claim_attempt_retrying(store, tries=2, backoff_s=0.01)


def _emit_steps(log: EventLog, steps: range) -> None:
    for s in steps:
        log.emit("step_done", quiet=True, step=s, seconds=0.1)


def test_shipments_hold_every_event_once_in_order(backend, tmp_path):
    store = backend.store
    log = EventLog(str(tmp_path / "events.jsonl"), run_id="r", attempt=1)
    shipper = Shipper(store, 1, writer="w")
    log.add_sink(shipper)
    log.emit("start", quiet=True, world=1)
    _emit_steps(log, range(1, 4))
    first = shipper.ship()
    _emit_steps(log, range(4, 6))
    log.emit("end", quiet=True, step=5)
    second = shipper.ship()
    assert shipper.ship() is None and shipper.pending == 0  # nothing queued: nothing written
    log.close()
    assert (first, second) == ("events/00000001-0000000000-w.jsonl", "events/00000001-0000000004-w.jsonl")
    local = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert read_store_events(store) == local
    # Another attempt's events come after, whatever its machine's file held.
    other = Shipper(store, 2, writer="v")
    other.write({"ts": 0.0, "event": "start", "run_id": "r", "attempt": 2})
    other.ship()
    assert [e["attempt"] for e in read_store_events(store)] == [1] * 7 + [2]


def test_a_save_does_not_commit_until_its_events_are_shipped(backend):
    """The saver's hook runs between the blobs and the manifest: if the events cannot be written, the
    checkpoint is not committed (a failed save), and the events stay queued for the next shipment."""
    store = backend.store
    shipper = Shipper(store, 1, writer="w", attempts=2, backoff_s=0.01)
    calls = []

    def hook(snap):
        calls.append(snap.step)
        if snap.step == 1:  # as a shipment that ran out of tries (S3's own refusal: the next test)
            raise SaveFailed("events could not be written")
        shipper.before_commit(snap)

    saver = AsyncSaver(CheckpointWriter(store, "r"), before_commit=hook)
    shipper.write({"ts": 1.0, "event": "step", "step": 1, "attempt": 1})
    snap = snapshot(1, 8, {"model": {}}, documents={}, config_hash="h")
    with pytest.raises(SaveFailed, match="events could not be written"):
        saver.save(snap, "n1")
    assert list_manifests(store) == [] and shipper.pending == 1
    shipper.write({"ts": 2.0, "event": "step", "step": 2, "attempt": 1})
    saver.save(snapshot(2, 16, {"model": {}}, documents={}, config_hash="h"), "n2")
    saver.close()
    assert [i.key for i in list_manifests(store)] == ["manifests/000000000002.json"] and calls == [1, 2]
    assert [e["step"] for e in read_store_events(store)] == [1, 2]


def test_s3_events_put_refused_fails_the_save_then_a_lost_reply_is_merged_once(proxied_s3):
    store, proxy = proxied_s3
    shipper = Shipper(store, 1, writer="w", attempts=2, backoff_s=0.01)
    saver = AsyncSaver(CheckpointWriter(store, "r"), before_commit=shipper.before_commit)
    shipper.write({"ts": 1.0, "event": "step", "step": 1, "attempt": 1})
    proxy.add("error", method="PUT", path=r"/events/00000001-", times=100)
    with pytest.raises(SaveFailed, match=r"manifest: .*events \(attempt 1\) not shipped after 2 tries"):
        saver.save(snapshot(1, 8, {"model": {}}, documents={}, config_hash="h"), "n1")
    assert list_manifests(store) == [] and shipper.pending == 1
    proxy.clear()
    # The events' PUT lands, its reply is lost: the store's retry finds the key taken (412), which is ours.
    proxy.add("drop_after", method="PUT", path=r"/events/00000001-", times=1)
    shipper.write({"ts": 2.0, "event": "step", "step": 2, "attempt": 1})
    saver.save(snapshot(2, 16, {"model": {}}, documents={}, config_hash="h"), "n2")
    saver.close()
    assert [i.key for i in list_manifests(store)] == ["manifests/000000000002.json"]
    assert shipper.pending == 0
    assert [e["step"] for e in read_store_events(store)] == [1, 2]
    assert any(s.fault == "drop_after" for s in proxy.seen)


def test_the_last_shipment_never_raises_and_keeps_what_it_could_not_write(tmp_path, caplog):
    from elastic_ft.checkpoint.local import LocalStore

    root = tmp_path / "run"
    root.mkdir()
    (root / "events").write_text("a file where the events' directory should be")  # every put under it fails
    shipper = Shipper(LocalStore(str(root)), 3, writer="w", attempts=2, backoff_s=0.01)
    shipper.write({"ts": 1.0, "event": "end", "attempt": 3})
    shipper.ship_final()
    assert shipper.pending == 1 and "the last events of attempt 3 were not shipped" in caplog.text
    (root / "events").unlink()
    shipper.ship_final()
    assert shipper.pending == 0 and [e["event"] for e in read_store_events(LocalStore(str(root)))] == ["end"]


def test_a_runs_events_are_read_by_its_location(tmp_path):
    """``store_events`` (``elastic-ft events``/``status``) and ``load_run_events`` (``goodput``, ``plot``) read
    the same shipments from a run's URI, and name where they came from."""
    from elastic_ft.checkpoint.local import LocalStore
    from elastic_ft.runevents.load import load_run_events, store_events

    uri = f"file://{tmp_path}/run/"
    (tmp_path / "run").mkdir()
    shipper = Shipper(LocalStore(str(tmp_path / "run")), 1, writer="w")
    shipper.write({"ts": 1.0, "event": "start", "attempt": 1})
    shipper.ship()
    assert [e["event"] for e in store_events(uri)] == ["start"]
    assert load_run_events(uri) == (f"file://{tmp_path}/run/events/", store_events(uri))


def test_the_store_holds_each_event_as_the_file_wrote_it(tmp_path):
    """Each event is serialised once, by the log, and the shipper queues that very line (no second
    json.dumps per step on the leader): a value whose text changes at every str() shows it."""
    from elastic_ft.checkpoint.local import LocalStore

    class Ticks:
        n = 0

        def __str__(self) -> str:
            Ticks.n += 1
            return f"tick-{Ticks.n}"

    (tmp_path / "run").mkdir()
    shipper = Shipper(LocalStore(str(tmp_path / "run")), 1, writer="w")
    log = EventLog(str(tmp_path / "events.jsonl"), run_id="r", attempt=1)
    log.add_sink(shipper)
    log.emit("step", quiet=True, step=1, note=Ticks())
    key = shipper.ship()
    log.close()
    assert Ticks.n == 1
    assert bytes(shipper.store.get(key)) == (tmp_path / "events.jsonl").read_bytes()
