"""The fast subset at the start of a multi-node job: run by the etcd3 handler, warnings only, never raising."""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ft.doctor import rendezvous
from elastic_ft.preflight import startup
from elastic_ft.preflight import versions as node_versions
from elastic_ft.rendezvous.handler import create_handler
from tests.ports import free_port

OTHER = {"torch": "0.0.1", "cuda": "none", "nccl": "none", "elastic_ft": "0.0.0", "python": "3.0.0"}


def test_the_handler_posts_this_nodes_versions_and_warns_of_a_mismatch(etcd, run_id, caplog):
    options, client = rendezvous.open_client(etcd.endpoint, {})
    prefix = node_versions.versions_prefix(options.run_prefix(run_id))
    node_versions.post_versions(client, prefix, "old-node-1", OTHER)
    client.close()
    caplog.set_level(logging.INFO, logger="elastic_ft.preflight")
    handler = create_handler(RendezvousParameters("etcd3", etcd.endpoint, run_id, 1, 2))
    try:
        posted = node_versions.read_versions(handler.etcd_client, prefix)
    finally:
        handler.etcd_client.revoke_lease()
        handler.etcd_client.close()
    assert set(posted) == {"old-node-1", node_versions.node_name()}
    lines = {r.getMessage().split()[3].rstrip(":"): r for r in caplog.records if "elastic-ft doctor" in r.getMessage()}
    assert lines["versions"].levelno == logging.WARNING and "old-node-1" in lines["versions"].getMessage()
    # etcd on 127.0.0.1: every node is on this machine, where a loopback hostname is right.
    assert lines["hostname"].getMessage().startswith("elastic-ft doctor: SKIP hostname")


def test_a_single_node_job_runs_nothing():
    assert startup.report_at_startup(None, "/p/", 1, ["10.0.0.1"], {}) == []


def test_etcd_trouble_is_one_warning_not_an_error(caplog):
    _, client = rendezvous.open_client(f"127.0.0.1:{free_port()}", {})
    results = startup.report_at_startup(client, "/p/", 4, ["10.0.0.1"], {"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert [r.status for r in results][1:] == ["FAIL", "WARN"]  # interface; versions could not be posted
    assert any("could not post" in r.getMessage() for r in caplog.records)


def test_opt_out():
    assert startup.report_at_startup(None, "/p/", 4, ["10.0.0.1"], {startup.OPT_OUT_ENV: "0"}) == []
