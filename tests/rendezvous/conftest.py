"""Fixtures of the rendezvous tests: real etcd processes on 127.0.0.1.

``etcd`` (one member shared by the session: tests use unique run ids) and ``etcd_tls`` (TLS with
client certificates, auth enabled) come from tests/servers.py; ``etcd_private`` is a member of a
test's own, for tests that restart or stop it.
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

from etcd_server import EtcdServer  # noqa: E402

if shutil.which("etcd") is None:
    pytest.skip(
        "etcd is not installed: run scripts/setup.sh --test (Debian package etcd-server).",
        allow_module_level=True,
    )


@pytest.fixture
def etcd_private(tmp_path: Path) -> EtcdServer:
    server = EtcdServer(tmp_path / "etcd-data").start()
    yield server
    server.stop()


_run_ids = itertools.count()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id unique within the session, readable in etcd dumps."""
    # Run ids are checked (elastic_ft.config.names): keep to its character set and length.
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"{name}-{os.getpid()}-{next(_run_ids)}"
