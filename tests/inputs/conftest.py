"""Fixtures of the input-cache tests: the checkpoint tests' S3 servers and fault proxy, reused,
and a bucket prefix per test reached through a proxy that records every request."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.inputs.resolve import InputSource
from elastic_ft.inputs.settings import InputsConfig
from tests.checkpoint.conftest import fault_proxy, s3_env  # noqa: F401 (fixtures, reused)
from tests.checkpoint.s3_servers import S3_BACKENDS, S3Endpoint

# Quick retries: a test that fails should not wait out AWS-sized backoffs.
FAST = S3Options(max_attempts=3, backoff_initial=0.01, backoff_max=0.05, connect_timeout=5, read_timeout=10)


@dataclasses.dataclass
class Remote:
    """A fresh prefix of a test bucket, the proxy in front of its server, and a cache directory."""

    endpoint: S3Endpoint
    proxy: object
    prefix: str
    cache_dir: str

    def uri(self, key: str) -> str:
        return f"s3://{self.endpoint.bucket}/{self.prefix}{key}"

    def put(self, key: str, body: bytes) -> None:
        self.endpoint.client().put_object(Bucket=self.endpoint.bucket, Key=self.prefix + key, Body=body)

    def delete(self, key: str) -> None:
        self.endpoint.client().delete_object(Bucket=self.endpoint.bucket, Key=self.prefix + key)

    def gets(self, key: str = "") -> int:
        """GETs of objects (not listings) under this prefix (or of ``key``) that reached the proxy."""
        path = f"/{self.endpoint.bucket}/{self.prefix}{key}"
        return sum(1 for s in self.proxy.seen if s.method == "GET" and s.path.split("?")[0].startswith(path))

    def source(self, s3: S3Options = FAST, **settings) -> InputSource:
        return InputSource(InputsConfig(cache_dir=self.cache_dir, **settings), s3)


def _remote(name, s3_servers, s3_env, fault_proxy, tmp_path) -> Remote:  # noqa: F811
    endpoint = s3_servers.get(name)
    proxy = fault_proxy(endpoint)
    s3_env(endpoint, endpoint_url=proxy.url)
    return Remote(endpoint, proxy, f"inputs/{uuid.uuid4().hex[:12]}/", str(tmp_path / "cache"))


@pytest.fixture(params=S3_BACKENDS)
def remote(request, s3_servers, s3_env, fault_proxy, tmp_path) -> Remote:  # noqa: F811
    """Each S3 server in turn (moto, SeaweedFS)."""
    return _remote(request.param, s3_servers, s3_env, fault_proxy, tmp_path)


@pytest.fixture
def moto_remote(s3_servers, s3_env, fault_proxy, tmp_path) -> Remote:  # noqa: F811
    """The moto server only: for behaviour that does not depend on the server."""
    return _remote("moto", s3_servers, s3_env, fault_proxy, tmp_path)
