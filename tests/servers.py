"""The real servers the tests share: one etcd, one TLS etcd with auth, one of each S3 server, per session.

tests/conftest.py imports these fixtures, so every test directory gets the same servers (they were
started once per directory, and once per module for the multi-node tests). A server starts when the
first test that needs it runs, so ``-k`` or ``--quick`` start none that no selected test uses. Tests
share them safely because each keeps to its own keys: unique run ids in etcd, a prefix of its own in
the S3 bucket. A test that stops, restarts or reconfigures a server starts one of its own
(``etcd_private`` in tests/rendezvous).
"""

from __future__ import annotations

import logging
import shutil

import pytest


def _need_etcd() -> None:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed: run scripts/setup.sh --test (Debian package etcd-server)")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """One plain etcd member on 127.0.0.1 (tests use unique run ids)."""
    from tests.rendezvous.etcd_server import EtcdServer

    _need_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    from tests.rendezvous.etcd_server import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def etcd_tls(tmp_path_factory, tls_files):
    """etcd serving TLS with client certificates, auth enabled (root's password: ``ROOT_PASSWORD``)."""
    from tests.rendezvous.etcd_server import ROOT_PASSWORD, EtcdServer

    _need_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd-tls") / "data", tls=tls_files).start()
    server.enable_auth(ROOT_PASSWORD)
    yield server
    server.stop()


class S3Servers:
    """Starts each S3 server the first time a test asks for it; stops them all at the end.

    One session fixture that starts servers on demand, rather than one fixture
    per server fetched with ``getfixturevalue``: pytest tears such dynamically
    requested session fixtures down and up again between parametrized modules,
    which restarted SeaweedFS for nothing.
    """

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._running: dict[str, object] = {}
        self._endpoints: dict = {}

    def get(self, name: str):
        """The running server ``name`` (``moto`` or ``seaweedfs``) as an ``S3Endpoint``."""
        from tests.checkpoint.s3_servers import S3_BACKENDS, MotoServer, SeaweedServer

        if name not in self._endpoints:
            if name == "moto":
                logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
                server = MotoServer()
            elif name == "seaweedfs":
                server = SeaweedServer(str(self._tmp.mktemp("seaweedfs")))
            else:
                raise ValueError(f"unknown S3 test server {name!r}; choose one of {', '.join(S3_BACKENDS)}")
            self._endpoints[name] = server.start()
            self._running[name] = server
        return self._endpoints[name]

    def stop(self) -> None:
        for server in self._running.values():
            server.stop()
        self._running.clear()
        self._endpoints.clear()


@pytest.fixture(scope="session")
def s3_servers(tmp_path_factory) -> S3Servers:
    servers = S3Servers(tmp_path_factory)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def seaweed(s3_servers):
    """The session's SeaweedFS (checks signatures and Content-MD5): children must use the credentials given."""
    return s3_servers.get("seaweedfs")


@pytest.fixture
def seaweedfs(seaweed):
    return seaweed


@pytest.fixture
def moto(s3_servers):
    """The session's moto S3 server (in this process)."""
    return s3_servers.get("moto")
