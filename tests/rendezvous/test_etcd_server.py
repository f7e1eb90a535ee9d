"""The test etcd itself: its ports are picked before it binds them, so a port taken in between costs a retry."""

from __future__ import annotations

import socket

import pytest
from etcd_server import EtcdServer

pytestmark = pytest.mark.etcd


def test_a_first_start_whose_port_was_taken_meanwhile_binds_new_ports(tmp_path):
    server = EtcdServer(tmp_path / "data")
    taken = server.client_port
    with socket.socket() as squatter:  # another process got the port between the pick and etcd's bind
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.client_port != taken
            assert server.etcdctl("put", "k", "v").returncode == 0
            assert "address already in use" in server.log_path.read_text()  # the first try did fail to bind
        finally:
            server.stop()
