"""Contract tests of the etcd-backed torch.distributed.Store against a real etcd.

TCPStore semantics where torch's agent relies on them: blocking get/wait with
a timeout that raises DistStoreError, atomic add under contention,
compare_set, multi_get/multi_set through torch's PrefixStore, torch's own
barrier helper; plus keys under the run prefix, lease expiry, and waiting
through a watch rather than polling.
"""

from __future__ import annotations

import collections
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier

from elastic_ft.rendezvous.etcd import EtcdClient
from elastic_ft.rendezvous.options import parse_options
from elastic_ft.rendezvous.store import EtcdStore
from tests.waiting import wait_until

from threads import run_in_threads


def make_store(
    endpoint: str, run_id: str, timeout: float = 10, cas_max_attempts: int | None = None, **conf: str
) -> EtcdStore:
    options = parse_options(endpoint, conf)
    client = EtcdClient(options.connection, name=run_id)
    extra = {} if cas_max_attempts is None else {"cas_max_attempts": cas_max_attempts}
    return EtcdStore(
        client, options.run_prefix(run_id) + "store/", timedelta(seconds=timeout), **extra
    )


def test_set_then_get(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    store.set("k", "v")
    store.set("b", b"\x00\xff")
    assert store.get("k") == b"v"
    assert store.get("b") == b"\x00\xff"


def test_get_blocks_until_another_client_sets(etcd, run_id):
    reader = make_store(etcd.endpoint, run_id)
    writer = make_store(etcd.endpoint, run_id)
    started = threading.Event()

    def write_later() -> None:
        started.wait()
        writer.set("late", "here")

    t = threading.Thread(target=write_later)
    t.start()
    started.set()
    try:
        assert reader.get("late") == b"here"
    finally:
        t.join()


def test_get_times_out_with_store_error_naming_the_key(etcd, run_id):
    store = make_store(etcd.endpoint, run_id, timeout=1)
    with pytest.raises(dist.DistStoreError, match="missing-key"):
        store.get("missing-key")


def test_wait_uses_a_watch_not_polling(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    writer = make_store(etcd.endpoint, run_id)
    client = store._client
    reads = []
    original_get = client.get

    def counting_get(key):  # type: ignore[no-untyped-def]
        reads.append(key)
        return original_get(key)

    client.get = counting_get  # type: ignore[method-assign]
    timer = threading.Timer(1.5, writer.set, args=("watched", "1"))
    timer.start()
    try:
        store.wait(["watched"], timedelta(seconds=20))
    finally:
        timer.join()
    # One read to find it missing, then the watch delivers the put; a polling
    # loop would have read it many times in 1.5 s.
    assert len(reads) <= 2


def test_wait_override_timeout_and_check(etcd, run_id):
    store = make_store(etcd.endpoint, run_id, timeout=60)
    assert not store.check(["a", "b"])
    store.set("a", "1")
    assert store.check(["a"])
    assert not store.check(["a", "b"])
    with pytest.raises(dist.DistStoreError, match=r"keys: b \(1 of 2 missing"):
        store.wait(["a", "b"], timedelta(seconds=1))
    store.set("b", "2")
    store.wait(["a", "b"])
    assert store.check(["a", "b"])


def test_add_is_atomic_under_contention(etcd, run_id):
    stores = [make_store(etcd.endpoint, run_id) for _ in range(4)]
    per_thread = 10
    start = threading.Barrier(len(stores))

    def work(store: EtcdStore) -> None:
        start.wait()
        for _ in range(per_thread):
            store.add("counter", 1)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].add("counter", 0) == len(stores) * per_thread
    assert stores[0].get("counter") == str(len(stores) * per_thread).encode()


def test_add_negative_and_new_key(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2


def test_compare_set_follows_tcpstore(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    # Missing key with empty expectation: created.
    assert store.compare_set("k", "", "first") == b"first"
    # Matching expectation: replaced.
    assert store.compare_set("k", "first", "second") == b"second"
    # Mismatch: unchanged, current value returned.
    assert store.compare_set("k", "first", "third") == b"second"
    # Missing key with non-empty expectation: nothing set, expectation returned.
    assert store.compare_set("absent", "x", "y") == b"x"
    assert not store.check(["absent"])


def test_multi_set_and_multi_get(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    store.multi_set(["a", "b", "c"], ["1", b"2", "3"])
    assert store.multi_get(["c", "a", "b"]) == [b"3", b"1", b"2"]


def test_multi_get_blocks_until_all_keys_exist(etcd, run_id):
    store = make_store(etcd.endpoint, run_id, timeout=1)
    store.set("x", "1")
    with pytest.raises(dist.DistStoreError, match="Wait timeout after 1000ms, keys: y "):
        store.multi_get(["x", "y"])


def test_delete_key_and_num_keys(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    assert store.num_keys() == 0
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1


def test_keys_live_under_the_run_prefix(etcd, run_id):
    store = make_store(etcd.endpoint, run_id, key_prefix="/custom/prefix")
    store.set("k", "v")
    listing = etcd.etcdctl("get", "--prefix", "--keys-only", "/custom/prefix/").stdout.split()
    assert listing == [f"/custom/prefix/{run_id}/store/k"]


def test_store_keys_expire_with_the_lease(etcd, run_id):
    store = make_store(etcd.endpoint, run_id, lease_ttl="2")
    store.set("k", "v")
    wait_until(lambda: not store.check(["k"]), timeout=30, what="the store key to expire with its lease")


def test_works_through_torch_prefix_store(etcd, run_id):
    # The handler returns PrefixStore(f"torch.rendezvous.{run}.{round}", store).
    inner = make_store(etcd.endpoint, run_id)
    store = dist.PrefixStore("torch.rendezvous.r.0", inner)
    store.set("MASTER_ADDR", b"host")
    assert store.get("MASTER_ADDR") == b"host"
    assert store.add("n", 2) == 2
    store.multi_set(["r/0", "r/1"], ["a", "b"])
    assert store.multi_get(["r/0", "r/1"]) == [b"a", b"b"]
    assert store.compare_set("c", "", "x") == b"x"
    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"])
    assert inner.check(["torch.rendezvous.r.0/MASTER_ADDR"])


def test_torch_barrier_helper_across_clients(etcd, run_id):
    # torch's agent meets at its exit barrier through these store calls.
    world = 4
    stores = [make_store(etcd.endpoint, run_id) for _ in range(world)]
    run_in_threads(lambda rank: barrier(stores[rank], world, key_prefix="exit/", barrier_timeout=30, rank=rank), world)


def test_wait_survives_etcd_restart(etcd_private, run_id):
    store = make_store(etcd_private.endpoint, run_id, timeout=60)
    writer = make_store(etcd_private.endpoint, run_id)
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(store.get("after-restart")))
    waiting.start()
    etcd_private.stop()
    etcd_private.start()
    writer.set("after-restart", "ok")
    waiting.join(timeout=60)
    assert result == [b"ok"]


def test_store_connection_loss_is_a_store_error(etcd_private, run_id):
    store = make_store(etcd_private.endpoint, run_id, retry_timeout="1")
    etcd_private.stop()
    with pytest.raises(dist.DistStoreError, match=etcd_private.endpoint):
        store.set("k", "v")


def meddle_before_each_write(store: EtcdStore, meddler: EtcdStore, key: str, value: bytes):  # type: ignore[no-untyped-def]
    """Make another client rewrite ``key`` (same value, new revision) right before
    each of ``store``'s compare-and-put calls, so that every one of them loses;
    returns the list of calls made. After 50 calls it stops meddling, so that a
    loop without a bound ends too."""
    client = store.client
    original = client.compare_and_put
    calls: list[str] = []

    def compare_and_put(full_key, new, revision):  # type: ignore[no-untyped-def]
        calls.append(full_key)
        if len(calls) <= 50:
            meddler.set(key, value)
        return original(full_key, new, revision)

    client.compare_and_put = compare_and_put  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize(
    "operation",
    [
        lambda store: store.add("hot", 1),
        lambda store: store.append("hot", "x"),
        lambda store: store.compare_set("hot", "7", "8"),
    ],
    ids=["add", "append", "compare_set"],
)
def test_compare_and_swap_gives_up_after_bounded_attempts(etcd, run_id, operation):
    store = make_store(etcd.endpoint, run_id, cas_max_attempts=5)
    meddler = make_store(etcd.endpoint, run_id)
    meddler.set("hot", "7")
    calls = meddle_before_each_write(store, meddler, "hot", b"7")
    with pytest.raises(dist.DistStoreError, match=r"'hot' after 5 compare-and-swap attempts"):
        operation(store)
    assert len(calls) == 5
    assert meddler.get("hot") == b"7"  # the failed call wrote nothing


def test_compare_and_swap_gives_up_at_the_store_timeout(etcd, run_id):
    # A store timeout of 0 leaves time for exactly one attempt.
    store = make_store(etcd.endpoint, run_id, timeout=0)
    meddler = make_store(etcd.endpoint, run_id)
    meddler.set("hot", "1")
    calls = meddle_before_each_write(store, meddler, "hot", b"1")
    with pytest.raises(dist.DistStoreError, match=r"'hot' after 1 compare-and-swap attempts"):
        store.add("hot", 1)
    assert len(calls) == 1


def test_add_on_a_value_that_is_not_a_counter_names_the_key(etcd, run_id):
    store = make_store(etcd.endpoint, run_id)
    make_store(etcd.endpoint, run_id).set("text", "abc")
    with pytest.raises(ValueError, match=r"key 'text' holds b'abc', not a decimal integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"


def _count_rpcs(monkeypatch) -> collections.Counter:  # type: ignore[no-untyped-def]
    """Count, by method, the gRPC calls of every etcd channel opened from now on."""
    import grpc

    counts: collections.Counter = collections.Counter()

    class Counting(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
        def intercept_unary_unary(self, call, details, request):  # type: ignore[no-untyped-def]
            counts[details.method.rsplit("/", 1)[-1]] += 1
            return call(details, request)

        def intercept_stream_stream(self, call, details, requests):  # type: ignore[no-untyped-def]
            counts[details.method.rsplit("/", 1)[-1]] += 1
            return call(details, requests)

    plain = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel", lambda *a, **k: grpc.intercept_channel(plain(*a, **k), Counting()))
    return counts


def test_wait_for_many_keys_reads_and_watches_them_together(etcd, run_id, monkeypatch):
    # Agents meeting at a barrier of N keys each wait for all N: one read and
    # one watch per key made that N*N requests to etcd (4096 at 64 nodes).
    writer = make_store(etcd.endpoint, run_id)
    keys = [f"met/{i}" for i in range(20)]
    writer.multi_set(keys[:10], ["1"] * 10)  # connects the writer before counting starts
    counts = _count_rpcs(monkeypatch)
    store = make_store(etcd.endpoint, run_id, timeout=60)
    t = threading.Thread(target=writer.multi_set, args=(keys[10:], ["2"] * 10))
    t.start()  # before or after the waiter's read: either way one read and at most one watch
    try:
        store.wait(keys)
    finally:
        t.join()
    assert counts["Txn"] + counts["Range"] == 1 and counts["Watch"] <= 1, counts
    counts.clear()
    assert store.multi_get(keys) == [b"1"] * 10 + [b"2"] * 10
    assert sum(counts.values()) == 2, counts  # the wait's read and multi_get's own


def test_more_keys_than_one_etcd_transaction_holds(etcd, run_id):
    # etcd refuses a transaction of more than --max-txn-ops operations (128 by default,
    # as the session's etcd runs): torch's rank assignment reads and writes one key per
    # node, so 200 nodes need 200 at once (the handler's meeting counts its keys instead).
    keys = [f"torchelastic/role_info/{i}" for i in range(200)]
    values = [f"v{i}".encode() for i in range(200)]
    # As torch's handler hands them out; Python must hold the inner stores (pybind).
    inner = [make_store(etcd.endpoint, run_id) for _ in range(2)]
    store, writer = (dist.PrefixStore("torch.rendezvous.r.0", s) for s in inner)
    assert not store.check(keys)
    writer.multi_set(keys[:150], values[:150])
    late = threading.Thread(target=writer.multi_set, args=(keys[150:], values[150:]))
    late.start()  # during the wait, or before it: either way the wait ends with all 200
    try:
        store.wait(keys)
    finally:
        late.join()
    assert store.check(keys)
    assert store.multi_get(keys) == values


def test_a_wait_over_several_transactions_misses_no_put_between_them(etcd, run_id, monkeypatch):
    # 200 keys are read in two transactions, at two revisions. A key read missing in the
    # first and put before the second must still end the wait: its watch starts after the
    # first read's revision, not the second's (from which it would wait for nothing).
    import grpc

    keys = [f"met/{i}" for i in range(200)]
    writer = make_store(etcd.endpoint, run_id)
    writer.multi_set(keys[1:], ["1"] * 199)  # connects the writer before the hook below
    txns = []

    class PutBetweenReads(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, call, details, request):  # type: ignore[no-untyped-def]
            outcome = call(details, request)
            if details.method.endswith("/Txn"):
                txns.append(details.method)
                if len(txns) == 1:
                    writer.set(keys[0], "late")  # after the first read, before the second
            return outcome

    plain = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel",
                        lambda *a, **k: grpc.intercept_channel(plain(*a, **k), PutBetweenReads()))
    store = make_store(etcd.endpoint, run_id, timeout=5)
    store.wait(keys)
    assert len(txns) == 2  # the two chunks of the wait's read, nothing read again
    assert store.get(keys[0]) == b"late"


def test_a_round_meets_once_every_member_is_in_and_a_stale_meeting_never_opens_it(etcd, run_id):
    """The meeting that ends a round (elastic_ft.rendezvous.meeting, the handler's last step of a round) on a
    real etcd: the barrier opens once the round's last member is in, and an earlier meeting of the same round
    number (an expired rendezvous state starts again at round 0 while an earlier job's keys may live on)
    opens none."""
    from elastic_ft.rendezvous.meeting import MET_ALL, MET_PREFIX, meet, meeting_of

    members = frozenset({"hostA_101_0", "hostB_102_0", "hostC_103_0"})
    earlier = make_store(etcd.endpoint, run_id)
    stale = meeting_of(0, {"hostA_901_0", "hostB_902_0", "hostC_903_0"})
    for key in [f"{MET_PREFIX}{stale}/{rank}" for rank in range(3)] + [f"{MET_ALL}{stale}"]:
        earlier.set(key, b"1")

    def member(rank: int, timeout: float = 10) -> None:
        meet(make_store(etcd.endpoint, run_id, timeout=timeout), 0, members, rank)

    # Two of the three members: the stale meeting's keys do not count, so their wait runs out.
    with pytest.raises(dist.DistStoreError, match="Wait timeout"):
        run_in_threads(lambda rank: member(rank, timeout=1.5), 2)
    run_in_threads(member, 3)  # all three: every member returns
