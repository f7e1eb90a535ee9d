"""Fixtures for the checkpoint store tests: real S3 servers, the fault proxy, stores.

The servers are the session's (``s3_servers``, tests/servers.py), started only when a test
asks for one, so ``-k file`` runs without starting any. Every store gets its own key prefix,
so tests share a server without seeing each other's objects.
"""

from __future__ import annotations

import dataclasses

import pytest

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.store import ObjectStore

try:  # a package when tests/ gains __init__.py files, plain modules otherwise
    from .fault_proxy import FaultProxy
    from .s3_servers import S3_BACKENDS, S3Endpoint, make_s3_store
except ImportError:
    from fault_proxy import FaultProxy
    from s3_servers import S3_BACKENDS, S3Endpoint, make_s3_store


@pytest.fixture
def s3_env(monkeypatch, tmp_path):
    """Isolate boto3 from the developer's AWS config; return a function that points it at an endpoint.

    The store builds its own client from the standard sources, so tests set
    those sources (environment variables) rather than passing a client in.
    """
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ELASTIC_FT_S3_SSE", raising=False)
    monkeypatch.delenv("ELASTIC_FT_S3_SSE_KMS_KEY_ID", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    def use(endpoint: S3Endpoint, *, endpoint_url: str | None = None) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", endpoint.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", endpoint.secret_key)
        monkeypatch.setenv("AWS_DEFAULT_REGION", endpoint.region)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint_url or endpoint.endpoint_url)

    return use


@dataclasses.dataclass
class Backend:
    """A store under test plus what a test needs to look behind it."""

    name: str
    store: ObjectStore
    endpoint: S3Endpoint | None = None  # None for the filesystem
    prefix: str = ""  # the S3 key prefix of the store's root

    def s3_head(self, key: str) -> dict:
        return self.endpoint.client().head_object(Bucket=self.endpoint.bucket, Key=self.prefix + key)


@pytest.fixture(params=("file",) + S3_BACKENDS)
def backend(request, tmp_path, s3_env, s3_servers) -> Backend:
    """Each store backend in turn: the filesystem, moto and SeaweedFS."""
    if request.param == "file":
        yield Backend("file", LocalStore(str(tmp_path / "store")))
        return
    endpoint = s3_servers.get(request.param)
    s3_env(endpoint)
    store, prefix = make_s3_store(endpoint)
    try:
        yield Backend(request.param, store, endpoint, prefix)
    finally:
        store.close()


@pytest.fixture
def fault_proxy():
    """Start a fault proxy in front of an endpoint: ``fault_proxy(endpoint) -> FaultProxy``."""
    started: list[FaultProxy] = []

    def start(endpoint: S3Endpoint) -> FaultProxy:
        proxy = FaultProxy(endpoint.endpoint_url).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()
