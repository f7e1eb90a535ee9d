"""The rendezvous and versions checks against a real etcd, and their decisions on given inputs."""

from __future__ import annotations

import time

import pytest

from elastic_ft.doctor import rendezvous
from elastic_ft.preflight import versions as node_versions
from tests.ports import free_port
from tests.rendezvous.etcd_server import ROOT_PASSWORD

V1 = {"torch": "2.13.0", "cuda": "none", "nccl": "none", "elastic_ft": "0.1.0", "python": "3.12.3"}


def _check(endpoint: str, conf: dict | None = None, environ: dict | None = None):
    _, client = rendezvous.open_client(endpoint, conf or {}, environ or {})
    try:
        return rendezvous.check_etcd(client)
    finally:
        client.close()


def test_etcd_down_fails_quickly_with_the_fix():
    started = time.monotonic()
    r = _check(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 10  # no long retries
    assert r.status == "FAIL" and "did not answer" in r.found
    assert "start etcd" in r.fix


def test_real_etcd_passes_reporting_its_v3_version(etcd):
    r = _check(etcd.endpoint)
    assert r.status == "PASS", r.line()
    assert r.found.startswith("etcd 3.") and etcd.endpoint in r.found


def test_tls_and_auth_options_as_rdzv_conf_takes_them(etcd_tls, tls_files):
    conf = {"ca_cert": tls_files.ca_cert, "client_cert": tls_files.client_cert, "client_key": tls_files.client_key,
            "user": "root", "password_env": "ETCD_PW"}
    assert _check(etcd_tls.endpoint, conf, {"ETCD_PW": ROOT_PASSWORD}).status == "PASS"
    wrong = _check(etcd_tls.endpoint, conf, {"ETCD_PW": "wrong"})
    assert wrong.status == "FAIL" and "refused" in wrong.found


def test_etcd_result_refuses_a_non_v3_version():
    assert rendezvous.etcd_result("h:2379", "2.3.8", None).status == "FAIL"


def test_rdzv_conf_is_parsed_as_torchrun_does():
    assert rendezvous.parse_conf("a=1, b=x=y,") == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="'oops' is not key=value"):
        rendezvous.parse_conf("a=1,oops")


def _post(etcd, prefix: str, node: str, versions: dict) -> None:
    _, client = rendezvous.open_client(etcd.endpoint, {})
    try:
        node_versions.post_versions(client, prefix, node, versions)
    finally:
        client.close()


def _read(etcd, prefix: str) -> dict:
    _, client = rendezvous.open_client(etcd.endpoint, {})
    try:
        return node_versions.read_versions(client, prefix)
    finally:
        client.close()


def test_versions_that_differ_between_two_posted_nodes_fail_naming_both(etcd, run_id):
    options, _ = rendezvous.open_client(etcd.endpoint, {})
    prefix = node_versions.versions_prefix(options.run_prefix(run_id))
    _post(etcd, prefix, "node-a-1", V1)
    _post(etcd, prefix, "node-b-2", {**V1, "torch": "2.12.0", "nccl": "2.21.5"})
    r = node_versions.versions_result(_read(etcd, prefix))
    assert r.status == "FAIL", r.line()
    assert "torch: 2.13.0 on node-a-1; 2.12.0 on node-b-2" in r.found
    assert "nccl: none on node-a-1; 2.21.5 on node-b-2" in r.found
    assert "python" not in r.found


def test_versions_that_agree_pass_and_live_on_a_lease(etcd, run_id):
    options, client = rendezvous.open_client(etcd.endpoint, {})
    prefix = node_versions.versions_prefix(options.run_prefix(run_id))
    assert prefix == f"/elastic_ft/rendezvous/{run_id}/doctor/versions/"
    try:
        node_versions.post_versions(client, prefix, "node-a-1", V1)
        assert 0 < client.lease_remaining_ttl(client.lease_id) <= node_versions.VERSIONS_TTL_S
    finally:
        client.close()
    _post(etcd, prefix, "node-b-2", dict(V1))
    r = node_versions.versions_result(_read(etcd, prefix))
    assert r.status == "PASS" and r.found.startswith("2 node(s) agree: torch 2.13.0"), r.line()


def test_versions_nothing_posted_skips():
    assert node_versions.versions_result({}).status == "SKIP"


def test_local_versions_have_every_field():
    assert set(node_versions.local_versions()) == set(node_versions.FIELDS)
