"""S3-only behaviour of the store: configuration (URIs, endpoints, profiles), encryption, errors.

The I/O contract shared with the filesystem is in ``test_store_contract.py``;
faults are in ``test_s3_faults.py``. These run against the real servers too.
"""

from __future__ import annotations

import io
import logging
import os

import pytest
from botocore.response import StreamingBody

from elastic_ft.checkpoint.digest import BlobDigest, blob_sha256
from elastic_ft.checkpoint.s3 import S3Store, default_concurrency, parse_s3_uri
from elastic_ft.checkpoint.s3.body import read_into as _read_into
from elastic_ft.checkpoint.store import StoreError, StoreUnavailable, open_store

try:
    from .s3_servers import FAST_S3_OPTIONS, make_s3_store
except ImportError:
    from s3_servers import FAST_S3_OPTIONS, make_s3_store

MiB = 1 << 20


def _head(endpoint, prefix, key):
    return endpoint.client().head_object(Bucket=endpoint.bucket, Key=prefix + key)


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [
        ("s3://b", "b", ""),
        ("s3://b/", "b", ""),
        ("s3://b/run-1", "b", "run-1/"),
        ("s3://b/team/run-1/", "b", "team/run-1/"),
    ],
)
def test_store_parse_s3_uri(uri, bucket, prefix):
    assert parse_s3_uri(uri) == (bucket, prefix)


@pytest.mark.parametrize("uri", ["s3://", "s3:///x", "file:///x", "s3://b/a//c", "s3://b/x?versionId=1"])
def test_store_parse_s3_uri_rejects(uri):
    with pytest.raises(StoreError, match="s3://bucket/prefix|'//'"):
        parse_s3_uri(uri)


@pytest.mark.parametrize("uri, segment", [("s3://bucket/../x", ".."), ("s3://bucket/runs/./r1", "."),
                                          ("s3://bucket/a/b/..", ".."), ("s3://bucket/..", "..")])
def test_store_parse_s3_uri_refuses_dot_segments_naming_the_uri(uri, segment):
    # s3://bucket/../x reached the server, whose HTTP 400 was reported as an endpoint problem.
    with pytest.raises(StoreError) as info:
        parse_s3_uri(uri)
    assert str(info.value) == (f"S3 URI {uri!r} has a {segment!r} path segment; S3 keys are not paths, so it "
                               f"would name no prefix you mean: write the prefix without it")


@pytest.mark.parametrize("uri", ["s3://../x", "s3://./x", "s3://-b/x", "s3://user@b/x", "s3://b:9000/x"])
def test_store_parse_s3_uri_refuses_what_is_not_a_bucket(uri):
    with pytest.raises(StoreError, match=r"is not a bucket name"):
        parse_s3_uri(uri)


def test_store_s3_options_are_validated_together(s3_env):
    with pytest.raises(StoreError) as info:
        S3Store("b", "p", client=object(), part_size=1024, max_attempts=0, max_concurrency=0)
    message = str(info.value)
    assert "part size (1024) must be at least 5 MiB" in message
    assert "attempt count (0)" in message and "concurrency (0)" in message


@pytest.mark.parametrize(
    ("sse", "key_id", "match"),
    [
        ("aes256", None, "'aes256' is not supported"),
        ("AES256", "alias/k", "takes no KMS key id"),
        ("none", "alias/k", "is 'none' but a KMS key id"),
    ],
)
def test_store_sse_options_are_validated(s3_env, sse, key_id, match):
    with pytest.raises(StoreError, match=match):
        S3Store("b", client=object(), sse=sse, sse_kms_key_id=key_id)


def test_store_open_store_dispatches_s3_and_uses_aws_endpoint_url(s3_env, s3_servers, monkeypatch):
    endpoint = s3_servers.get("moto")
    s3_env(endpoint)
    # The generic variable, not the S3-specific one: boto3 resolves both itself.
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.endpoint_url)
    store = open_store(f"s3://{endpoint.bucket}/open-store-run")
    try:
        assert isinstance(store, S3Store)
        assert store.uri == f"s3://{endpoint.bucket}/open-store-run"
        assert store.join("manifest.json") == f"s3://{endpoint.bucket}/open-store-run/manifest.json"
        store.put("manifest.json", b"{}")
        assert store.get("manifest.json") == b"{}"
        assert _head(endpoint, "open-store-run/", "manifest.json")["ContentLength"] == 2
    finally:
        store.close()


def test_store_uses_named_profile_with_endpoint(s3_env, s3_servers, tmp_path, monkeypatch):
    endpoint = s3_servers.get("seaweedfs")
    config = tmp_path / "aws-config"
    config.write_text(
        "[profile ckpt]\n"
        f"aws_access_key_id = {endpoint.access_key}\n"
        f"aws_secret_access_key = {endpoint.secret_key}\n"
        f"region = {endpoint.region}\n"
        f"endpoint_url = {endpoint.endpoint_url}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    store = S3Store.from_uri(f"s3://{endpoint.bucket}/profile-run", **FAST_S3_OPTIONS)
    try:
        store.put("a", b"via profile")
        assert store.get("a") == b"via profile"
    finally:
        store.close()


def test_store_wrong_credentials_fail_at_once_without_leaking(s3_env, s3_servers, monkeypatch, caplog):
    endpoint = s3_servers.get("seaweedfs")  # moto does not check signatures
    s3_env(endpoint)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-1234")
    store, _ = make_s3_store(endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            # Unavailable, not corrupt: a checkpoint is never judged by a store that refused to answer.
            refused = r"put of \S*ckpt/x was refused \(SignatureDoesNotMatch\)"
            with pytest.raises(StoreUnavailable, match=refused) as info:
                store.put("ckpt/x", b"x")
            with pytest.raises(StoreUnavailable, match=r"get of \S*ckpt/y was refused \(SignatureDoesNotMatch\)"):
                store.get_verified("ckpt/y", size=3 * MiB, sha256="0" * 64, chunk_size=MiB)
    finally:
        store.close()
    assert "not-the-secret-1234" not in str(info.value)
    assert caplog.records == []  # not transient: no retries


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ({"sse": "AES256"}, {"ServerSideEncryption": "AES256"}),
        ({"sse": "aws:kms", "sse_kms_key_id": "alias/ckpt"}, {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/ckpt"}),
        ({"env": {"ELASTIC_FT_S3_SSE": "AES256"}}, {"ServerSideEncryption": "AES256"}),
        (
            {"env": {"ELASTIC_FT_S3_SSE_KMS_KEY_ID": "arn:aws:kms:us-east-1:123456789012:key/abc"}},
            {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "arn:aws:kms:us-east-1:123456789012:key/abc"},
        ),
    ],
    ids=["aes256", "kms", "env-aes256", "env-kms-key-only"],
)
def test_store_server_side_encryption_is_sent(s3_env, s3_servers, monkeypatch, how, expected):
    endpoint = s3_servers.get("moto")  # moto records SSE headers; SeaweedFS has no KMS
    s3_env(endpoint)
    how = dict(how)
    for name, value in how.pop("env", {}).items():
        monkeypatch.setenv(name, value)
    store, prefix = make_s3_store(endpoint, **how)
    try:
        store.put("small", b"secret weights")
        store.put("large", os.urandom(6 * MiB))  # multipart: SSE goes on the create
        for key in ("small", "large"):
            head = _head(endpoint, prefix, key)
            assert {k: head.get(k) for k in expected} == expected, key
        assert store.get("small") == b"secret weights"
    finally:
        store.close()


def test_store_without_sse_sends_none(s3_env, s3_servers):
    endpoint = s3_servers.get("moto")
    s3_env(endpoint)
    store, prefix = make_s3_store(endpoint)
    try:
        store.put("plain", b"x")
        assert _head(endpoint, prefix, "plain").get("SSEKMSKeyId") is None
        assert store.sse_args == {}
    finally:
        store.close()


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_store_ranged_downloads_reuse_pooled_connections(s3_env, s3_servers, caplog, server):
    # Bodies are read straight from http.client (one copy); the connections must
    # still go back to urllib3's pool, or every ranged GET would open a new one.
    endpoint = s3_servers.get(server)
    s3_env(endpoint)
    store, _ = make_s3_store(endpoint)  # 1 MiB ranges, 4 in flight
    try:
        data = os.urandom(12 * MiB + 7)
        store.put("blobs/7-c/model", data)
        with caplog.at_level(logging.DEBUG, logger="urllib3.connectionpool"):
            for _ in range(3):
                assert store.get("blobs/7-c/model") == data
        opened = [r for r in caplog.records if "Starting new HTTP" in r.getMessage()]
        assert len(opened) <= store.max_concurrency, [r.getMessage() for r in opened]
    finally:
        store.close()


@pytest.mark.parametrize("verified", [False, True], ids=["get", "get_verified"])
def test_store_ranged_download_keeps_a_bounded_window_of_requests(s3_env, s3_servers, monkeypatch, verified):
    # However many ranges a download has, at most 2 * max_concurrency are
    # submitted and unfinished at once (the old store submitted them all).
    endpoint = s3_servers.get("moto")
    s3_env(endpoint)
    store, _ = make_s3_store(endpoint, max_concurrency=2)  # 1 MiB ranges: 13 of them
    try:
        data = os.urandom(12 * MiB + 7)
        store.put("blobs/7-w/model", data)
        pool = store._executor()
        submitted: list = []
        most = 0
        real_submit = pool.submit

        def spy(*args, **kwargs):
            nonlocal most
            fut = real_submit(*args, **kwargs)
            submitted.append(fut)
            most = max(most, sum(not f.done() for f in submitted))
            return fut

        monkeypatch.setattr(pool, "submit", spy)
        if verified:
            got = store.get_verified("blobs/7-w/model", size=len(data), sha256=blob_sha256(data, MiB), chunk_size=MiB)
        else:
            got = store.get("blobs/7-w/model")
        assert got == data
        assert len(submitted) == (13 if verified else 12) and most <= 4, (len(submitted), most)
    finally:
        store.close()


@pytest.mark.parametrize("chunk", [0, 1000, 4096])
def test_body_without_a_direct_socket_is_read_in_pieces_and_hashed_by_chunk(chunk):
    # A body that is not a plain urllib3 response (content-encoded, or another
    # HTTP stack) is read through botocore's readinto; chunks of a chunked
    # digest are hashed as they fill, from the range's offset in the blob.
    data = os.urandom(3 * (1 << 18) + 123)  # over three of the 256 KiB pieces
    offset = 3 * chunk  # the range's start in its blob: a chunk boundary
    into = memoryview(bytearray(len(data)))
    digest = BlobDigest(offset + len(data), chunk) if chunk else None
    assert _read_into(StreamingBody(io.BytesIO(data), len(data)), into, digest, offset) == len(data)
    assert into == data
    if digest is not None:
        digest.update(0, bytes(offset))  # the chunks before this range
        assert digest.hexdigest() == blob_sha256(bytes(offset) + data, chunk)
    short = memoryview(bytearray(len(data) + 10))
    assert _read_into(StreamingBody(io.BytesIO(data), len(data)), short) == len(data)


@pytest.mark.parametrize("cpus,expected", [(1, 3), (2, 6), (3, 9), (64, 10)])
def test_default_concurrency_is_three_per_usable_cpu_at_most_ten(monkeypatch, cpus, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert default_concurrency() == expected
    assert S3Store("b", "p", client=object()).max_concurrency == expected
    assert S3Store("b", "p", client=object(), max_concurrency=2).max_concurrency == 2
