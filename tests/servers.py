"""Module-scoped real servers on 127.0.0.1 for the multi-node process tests: etcd and SeaweedFS (S3).

Import the fixtures into a test module (``from tests.servers import etcd, seaweed``): one server of
each per module, stopped after its last test.
"""

from __future__ import annotations

import pytest

from tests.checkpoint.s3_servers import SeaweedServer
from tests.rendezvous.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    """A real S3 server (SeaweedFS checks signatures and Content-MD5): children must use the credentials given."""
    server = SeaweedServer(str(tmp_path_factory.mktemp("seaweedfs")))
    endpoint = server.start()
    yield endpoint
    server.stop()
