"""The S3 store under injected faults: a proxy between boto3 and a real server.

Each test programs the proxy for the next N matching requests, then checks that
the store retried (and logged it), or failed cleanly with a StoreError naming
the key and the attempt count, and that no partial data is ever returned.
"""

from __future__ import annotations

import hashlib
import logging
import os

import pytest

from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.store import ObjectExists, ObjectNotFound, StoreError, StoreUnavailable

try:
    from .s3_servers import S3_BACKENDS, make_s3_store
except ImportError:
    from s3_servers import S3_BACKENDS, make_s3_store

MiB = 1 << 20


@pytest.fixture(params=S3_BACKENDS)
def proxied(request, s3_env, s3_servers, fault_proxy):
    """(store, proxy, endpoint, prefix): a store whose endpoint is a fault proxy in front of a server."""
    endpoint = s3_servers.get(request.param)
    proxy = fault_proxy(endpoint)
    s3_env(endpoint, endpoint_url=proxy.url)
    stores = []

    def make(**options):
        store, prefix = make_s3_store(endpoint, **options)
        stores.append(store)
        return store, prefix

    store, prefix = make()
    yield store, proxy, endpoint, prefix, make
    for s in stores:
        s.close()


def _requests(proxy, method, key):
    return [s for s in proxy.seen if s.method == method and key in s.path]


def _retry_warnings(caplog, key):
    return [r for r in caplog.records if r.levelno == logging.WARNING and key in r.getMessage()]


class TestS3StoreFaults:
    def test_slowdown_is_retried_then_succeeds(self, proxied, caplog):
        store, proxy, *_ = proxied
        proxy.add("slowdown", method="PUT", path="ckpt/a.json", times=2)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            store.put("ckpt/a.json", b"payload")
        assert store.get("ckpt/a.json") == b"payload"
        assert [s.fault for s in _requests(proxy, "PUT", "ckpt/a.json")] == ["slowdown", "slowdown", None]
        warnings = _retry_warnings(caplog, "ckpt/a.json")
        assert len(warnings) == 2
        assert "SlowDown" in warnings[0].getMessage() and "attempt 1 of 4" in warnings[0].getMessage()

    def test_connection_dropped_before_forwarding_is_retried(self, proxied, caplog):
        store, proxy, *_ = proxied
        proxy.add("drop_before", method="PUT", path="ckpt/b.json")
        proxy.add("drop_before", method="GET", path="ckpt/b.json")
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            store.put("ckpt/b.json", b"bee")
            assert store.get("ckpt/b.json") == b"bee"
        assert [s.fault for s in _requests(proxy, "PUT", "ckpt/b.json")] == ["drop_before", None]
        assert len(_retry_warnings(caplog, "ckpt/b.json")) == 2

    def test_drop_after_commit_of_plain_put_is_retried(self, proxied):
        store, proxy, *_ = proxied
        proxy.add("drop_after", method="PUT", path="blobs/1-x/w")
        store.put("blobs/1-x/w", b"weights")
        assert store.get("blobs/1-x/w") == b"weights"
        assert len(_requests(proxy, "PUT", "blobs/1-x/w")) == 2

    def test_drop_after_commit_of_if_absent_put_gives_object_exists(self, proxied):
        # The ambiguous case: our first PUT committed but its answer was lost; the
        # retry meets our own object and gets 412. The store says ObjectExists and
        # the object is the one we wrote (the manifest writer compares its token).
        store, proxy, *_ = proxied
        proxy.add("drop_after", method="PUT", path="manifest-3.json")
        with pytest.raises(ObjectExists, match="manifest-3.json"):
            store.put("manifest-3.json", b'{"writer": "me"}', if_absent=True)
        assert store.get("manifest-3.json") == b'{"writer": "me"}'
        assert [s.fault for s in _requests(proxy, "PUT", "manifest-3.json")] == ["drop_after", None]

    @pytest.mark.parametrize("chunk_size", [0, MiB], ids=["plain", "chunked"])
    def test_truncated_download_is_retried_not_returned(self, proxied, caplog, chunk_size):
        # Chunked digests are computed in the download workers: only after a
        # range is whole, never over the truncated body of a failed try.
        store, proxy, *_ = proxied
        # Four ranged GETs, each longer than the 1000 bytes a truncation keeps: a
        # last range of 5 bytes, when it drew a truncation, came whole and was
        # rightly not retried, so the warnings counted one short.
        data = os.urandom(3 * MiB + 4096)
        digest = blob_sha256(data, chunk_size)
        store.put("blobs/2-t/model", data)
        store.put("blobs/2-t/small", b"0123456789")
        proxy.add("truncate", method="GET", path="blobs/2-t/model", times=2, keep=1000)
        proxy.add("truncate", method="GET", path="blobs/2-t/small", keep=3)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            assert store.get_verified("blobs/2-t/model", size=len(data), sha256=digest, chunk_size=chunk_size) == data
            assert store.get("blobs/2-t/small") == b"0123456789"
        assert sum(s.fault == "truncate" for s in proxy.seen) == 3
        assert len(_retry_warnings(caplog, "blobs/2-t/")) == 3

    def test_always_truncated_download_fails_cleanly(self, proxied):
        store, proxy, *_ = proxied
        store.put("blobs/2-t/bad", b"x" * 5000)
        proxy.add("truncate", method="GET", path="blobs/2-t/bad", times=100, keep=10)
        with pytest.raises(StoreError, match=r"get of \S*blobs/2-t/bad failed after 4 attempts"):
            store.get("blobs/2-t/bad")

    def test_delay_within_timeout_succeeds_without_retry(self, proxied, caplog):
        store, proxy, *_ = proxied
        store.put("ckpt/slow", b"patience")
        proxy.add("delay", method="GET", path="ckpt/slow", seconds=0.5)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            assert store.get("ckpt/slow") == b"patience"
        assert _retry_warnings(caplog, "ckpt/slow") == []
        assert [s.fault for s in _requests(proxy, "GET", "ckpt/slow")] == ["delay"]

    def test_delay_past_read_timeout_is_retried(self, proxied, caplog):
        _, proxy, _, _, make = proxied
        store, _ = make(read_timeout=1)
        store.put("ckpt/stall", b"eventually")
        proxy.add("delay", method="GET", path="ckpt/stall", seconds=5)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            assert store.get("ckpt/stall") == b"eventually"
        # The stalled first GET timed out and was retried. Usually the retry is
        # answered at once; on a busy machine it too may take over the 1 s read
        # timeout, and each such retry adds a Timeout warning of its own.
        assert [s.fault for s in _requests(proxy, "GET", "ckpt/stall")][:2] == ["delay", None]
        warnings = _retry_warnings(caplog, "ckpt/stall")
        assert warnings and all("Timeout" in w.getMessage() for w in warnings)

    def test_retries_exhausted_raise_store_error_with_key_and_count(self, proxied, caplog):
        store, proxy, endpoint, *_ = proxied
        proxy.add("slowdown", method="PUT", path="manifest-9.json", times=100)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            with pytest.raises(StoreError, match=r"put of \S*manifest-9\.json failed after 4 attempts.*SlowDown"):
                store.put("manifest-9.json", b"{}", if_absent=True)
        assert len(_requests(proxy, "PUT", "manifest-9.json")) == 4
        assert len(_retry_warnings(caplog, "manifest-9.json")) == 3
        assert not any(endpoint.secret_key in r.getMessage() for r in caplog.records)

    def test_large_blob_goes_up_in_parts_and_down_in_ranges(self, proxied):
        store, proxy, *_ = proxied
        data = os.urandom(11 * MiB)
        store.put("blobs/4-m/model", data)
        parts = [s for s in _requests(proxy, "PUT", "blobs/4-m/model") if "partNumber=" in s.path]
        assert len(parts) == 3
        proxy.clear()
        assert store.get_verified("blobs/4-m/model", size=len(data), sha256=hashlib.sha256(data).hexdigest()) == data
        ranges = sorted(s.range for s in _requests(proxy, "GET", "blobs/4-m/model"))
        assert len(ranges) == 11 and all(r and r.startswith("bytes=") for r in ranges)
        # A chunked digest that does not divide the 1 MiB download parts: the
        # ranges grow to whole chunks (1.5 MiB) so each worker hashes its own.
        proxy.clear()
        chunk = 768 * 1024
        assert store.get_verified("blobs/4-m/model", size=len(data), sha256=blob_sha256(data, chunk), chunk_size=chunk) == data
        starts = sorted(int(s.range.split("=")[1].split("-")[0]) for s in _requests(proxy, "GET", "blobs/4-m/model"))
        assert starts == list(range(0, len(data), 2 * chunk))

    def test_failed_part_is_retried(self, proxied):
        store, proxy, *_ = proxied
        data = os.urandom(11 * MiB)
        proxy.add("drop_before", method="PUT", path=r"blobs/4-p/model\?.*partNumber=2", times=2)
        store.put("blobs/4-p/model", data)
        assert store.get("blobs/4-p/model") == data

    def test_multipart_failure_aborts_upload(self, proxied):
        store, proxy, endpoint, prefix, _ = proxied
        proxy.add("slowdown", method="PUT", path=r"blobs/4-f/model\?.*partNumber=3", times=100)
        with pytest.raises(StoreError, match=r"upload part 3 of \S*blobs/4-f/model failed after 4 attempts"):
            store.put("blobs/4-f/model", os.urandom(11 * MiB))
        assert [s.fault for s in _requests(proxy, "DELETE", "blobs/4-f/model?uploadId=")] == [None]
        client = endpoint.client()
        uploads = client.list_multipart_uploads(Bucket=endpoint.bucket, Prefix=prefix).get("Uploads", [])
        assert uploads == []
        assert store.list("blobs/4-f/") == []

    def test_lost_answer_to_multipart_complete(self, proxied):
        store, proxy, *_ = proxied
        data = os.urandom(6 * MiB)
        proxy.add("drop_after", method="POST", path=r"blobs/4-c/model\?uploadId=")
        store.put("blobs/4-c/model", data)
        assert store.get("blobs/4-c/model") == data


class TestStoreCouldNotAnswer:
    """Faults that say nothing about the object are StoreUnavailable, never a plain
    StoreError, BlobMismatch or ObjectNotFound: resume must not take "could not
    read" for "corrupt" (and retire good checkpoints)."""

    def test_slowdown_on_every_get_is_unavailable(self, proxied):
        store, proxy, endpoint, *_ = proxied
        data = os.urandom(3 * MiB + 5)  # ranged GETs of a known size
        store.put("blobs/8-u/model", data)
        store.put("blobs/8-u/small", b"tiny")
        proxy.add("slowdown", method="GET", path="blobs/8-u/", times=1000)
        with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/8-u/small failed after 4 attempts.*SlowDown"):
            store.get("blobs/8-u/small")
        with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/8-u/model failed after 4 attempts.*SlowDown"):
            store.get_verified("blobs/8-u/model", size=len(data), sha256=blob_sha256(data, MiB), chunk_size=MiB)
        proxy.add("slowdown", method="GET", path="list-type=2", times=1000)
        with pytest.raises(StoreUnavailable, match=r"list of \S*blobs/\* failed after 4 attempts"):
            store.list("blobs/")
        # One ranged GET at a time until the size is known: no burst of doomed requests.
        assert len(_requests(proxy, "GET", "blobs/8-u/model")) == 4

    def test_connection_dropped_on_every_try_is_unavailable(self, proxied):
        store, proxy, *_ = proxied
        store.put("ckpt/gone", b"payload")
        proxy.add("drop_before", method="GET", path="ckpt/gone", times=1000)
        with pytest.raises(StoreUnavailable, match=r"get of \S*ckpt/gone failed after 4 attempts"):
            store.get("ckpt/gone")

    @pytest.mark.parametrize(
        ("status", "code", "message"),
        [
            (403, "AccessDenied", r"was refused \(AccessDenied\); check the credentials and the bucket policy"),
            (400, "ExpiredToken", r"was refused \(ExpiredToken\): the credentials have expired; refresh them"),
            (400, "InvalidRequest", r"failed: InvalidRequest \(HTTP 400\); check the endpoint"),
        ],
        ids=["access-denied", "expired-credentials", "unknown-error"],
    )
    def test_refused_or_unknown_error_is_unavailable_at_once(self, proxied, caplog, status, code, message):
        store, proxy, endpoint, *_ = proxied
        data = os.urandom(2 * MiB)
        store.put("blobs/8-d/model", data)
        proxy.add("error", method="GET", path="blobs/8-d/model", times=1000, status=status, code=code)
        proxy.add("error", method="GET", path="list-type=2", times=1000, status=status, code=code)
        proxy.add("error", method="PUT", path="blobs/8-d/other", times=1000, status=status, code=code)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/8-d/model " + message):
                store.get("blobs/8-d/model")
            with pytest.raises(StoreUnavailable, match=r"get of \S*blobs/8-d/model " + message):
                store.get_verified("blobs/8-d/model", size=len(data), sha256=blob_sha256(data, MiB), chunk_size=MiB)
            with pytest.raises(StoreUnavailable, match=r"list of \S*blobs/\* " + message):
                store.list("blobs/")
            with pytest.raises(StoreUnavailable, match=r"put of \S*blobs/8-d/other " + message) as info:
                store.put("blobs/8-d/other", b"x")
        assert caplog.records == []  # not transient: asked once each, no retries
        assert endpoint.secret_key not in str(info.value) and endpoint.access_key not in str(info.value)

    def test_not_found_stays_not_found(self, proxied):
        store, proxy, *_ = proxied
        with pytest.raises(ObjectNotFound, match="blobs/8-n/none"):
            store.get_verified("blobs/8-n/none", size=3 * MiB, sha256="0" * 64, chunk_size=MiB)
        assert len(_requests(proxy, "GET", "blobs/8-n/none")) == 1
