"""Fixtures of the rendezvous tests: real etcd processes on free 127.0.0.1 ports.

``etcd`` is one member shared by the session (tests use unique run ids);
``etcd_private`` is a member of a test's own, for tests that restart or stop it;
``etcd_tls`` serves TLS with client certificates and has auth enabled.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from etcd_server import ROOT_PASSWORD, EtcdServer, TlsFiles, make_tls_files  # noqa: E402

if shutil.which("etcd") is None:
    pytest.skip(
        "etcd is not installed: run scripts/setup.sh --test (Debian package etcd-server).",
        allow_module_level=True,
    )


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> EtcdServer:
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def etcd_private(tmp_path: Path) -> EtcdServer:
    server = EtcdServer(tmp_path / "etcd-data").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def etcd_tls(tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles) -> EtcdServer:
    server = EtcdServer(tmp_path_factory.mktemp("etcd-tls") / "data", tls=tls_files).start()
    server.enable_auth(ROOT_PASSWORD)
    yield server
    server.stop()


_run_ids = itertools.count()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id unique within the session, readable in etcd dumps."""
    # Run ids are checked (elastic_ft.config.names): keep to its character set and length.
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"{name}-{os.getpid()}-{next(_run_ids)}"
