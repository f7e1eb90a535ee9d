"""hostname, interface and port checks: the decisions on given inputs, and through the real resolver and sysfs."""

from __future__ import annotations

import socket

import pytest

from elastic_ft.preflight import network
from tests.ports import free_port


def test_hostname_mapped_to_debian_loopback_fails_with_the_fix():
    r = network.hostname_result("node-a", ["127.0.1.1", "10.0.0.5"], multi_node=True)
    assert r.status == "FAIL"
    assert "127.0.1.1" in r.found and "Debian" in r.found
    assert "/etc/hosts" in r.fix and "GLOO_SOCKET_IFNAME" in r.fix


def test_hostname_resolving_to_a_private_address_passes():
    r = network.hostname_result("node-a", ["10.0.0.5"], multi_node=True)
    assert (r.status, r.found) == ("PASS", "'node-a' resolves to 10.0.0.5")


def test_hostname_that_does_not_resolve_fails_and_single_node_skips():
    assert network.hostname_result("node-a", [], multi_node=True).status == "FAIL"
    assert network.hostname_result("node-a", ["127.0.1.1"], multi_node=False).status == "SKIP"


@pytest.mark.parametrize("name", ["127.0.1.1", "localhost"])
def test_real_resolver_name_mapped_to_loopback_fails(name):
    # getaddrinfo maps the literal 127.0.1.1 (and localhost) to loopback, as Debian's /etc/hosts maps the hostname.
    r = network.check_hostname(name, multi_node=True)
    assert r.status == "FAIL", r.line()
    assert "loopback" in r.found


def test_real_resolver_routable_address_passes():
    # A numeric address resolves without DNS; 192.0.2.0/24 is TEST-NET-1.
    r = network.check_hostname("192.0.2.10", multi_node=True)
    assert r.status == "PASS", r.line()


def test_interface_lo_exists_and_is_up_on_this_node():
    found = network.interfaces()
    assert found.get("lo") is True
    assert network.interface_result("GLOO_SOCKET_IFNAME", "lo", found).status == "PASS"
    assert network.interface_result("NCCL_SOCKET_IFNAME", "=lo", found).status == "PASS"


def test_missing_interface_fails_naming_it_and_listing_the_real_ones():
    r = network.check_interfaces({"GLOO_SOCKET_IFNAME": "lo,nosuch0"}, multi_node=True)[0]
    assert r.status == "FAIL", r.line()
    assert "nosuch0" in r.found and "lo(up)" in r.fix


def test_nccl_prefixes_exact_names_and_exclusions():
    found = {"lo": True, "eth0": True, "eth1": False, "docker0": True}
    assert network.interface_result("NCCL_SOCKET_IFNAME", "eth", found).status == "PASS"  # prefix
    assert network.interface_result("NCCL_SOCKET_IFNAME", "=eth", found).status == "FAIL"  # exact: no "eth"
    assert network.interface_result("GLOO_SOCKET_IFNAME", "eth", found).status == "FAIL"  # gloo: exact names
    assert network.interface_result("NCCL_SOCKET_IFNAME", "^docker,eth", found).status == "FAIL"  # nothing left
    r = network.interface_result("NCCL_SOCKET_IFNAME", "^docker", found)
    assert (r.status, r.found) == ("PASS", "NCCL_SOCKET_IFNAME='^docker' leaves eth0")
    down = network.interface_result("GLOO_SOCKET_IFNAME", "eth1", found)
    assert down.status == "FAIL" and "eth1 is down" in down.found


def test_no_interface_variable_is_a_skip():
    assert [r.status for r in network.check_interfaces({}, multi_node=True)] == ["SKIP"]


def test_rdzv_port_closed_fails_and_listening_passes():
    assert network.rdzv_port_result("h:1", network.reachable("127.0.0.1", free_port())).status == "FAIL"
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        assert network.reachable("127.0.0.1", port) is None


def test_master_port_free_passes_and_taken_warns():
    port = free_port()
    assert network.check_master_port({"MASTER_PORT": str(port)}).status == "PASS"
    with socket.create_server(("", port)):
        taken = network.check_master_port({"MASTER_PORT": str(port)})
        assert taken.status == "WARN" and str(port) in taken.found
        reached = network.check_master_port({"MASTER_PORT": str(port), "MASTER_ADDR": "127.0.0.1"})
        assert reached.status == "PASS"


def test_master_port_that_is_not_a_port_fails():
    assert network.check_master_port({"MASTER_PORT": "abc"}).status == "FAIL"
