"""The checkpoint store check against a server that ignores conditional writes, moto, and a directory; the clock."""

from __future__ import annotations

import email.utils
import os

import pytest

from elastic_ft.checkpoint.store import open_store
from elastic_ft.doctor import storage


def test_s3_endpoint_ignoring_conditional_writes_fails_and_cleans_up(s3_env, ignoring_s3):
    s3_env(ignoring_s3.url)
    probe = storage.probe_store("s3://bucket/runs/r1")
    r = storage.store_result(probe)
    assert r.status == "FAIL", r.line()
    assert "ignores conditional writes" in r.found and "overwrite" in r.found
    assert "SeaweedFS" in r.fix
    # Both creates sent the header, and the scratch object was removed afterwards.
    assert [h for _, h in ignoring_s3.puts] == ["*", "*"]
    assert ignoring_s3.deletes == [ignoring_s3.puts[0][0]]
    assert "/bucket/runs/r1/.doctor/" in ignoring_s3.puts[0][0]


@pytest.mark.s3server  # the server fixture is asked for by name
@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_real_s3_honouring_if_none_match_passes_and_leaves_nothing(s3_env, server, request):
    s3 = request.getfixturevalue(server)
    s3_env(s3.endpoint_url, s3.access_key, s3.secret_key)
    uri = f"s3://{s3.bucket}/doctor/r1"
    probe = storage.probe_store(uri)
    assert storage.store_result(probe).status == "PASS", storage.store_result(probe).line()
    assert storage.clock_result(probe.server_date, probe.local_time).status == "PASS"
    store = open_store(uri)
    try:
        assert store.list(".doctor/") == []
    finally:
        store.close()


def test_clock_skew_beyond_the_bound_fails_from_the_servers_date(s3_env, ignoring_s3):
    s3_env(ignoring_s3.url)
    ignoring_s3.skew_s = -600  # the server is 10 min behind this node
    probe = storage.probe_store("s3://bucket/runs/r1")
    r = storage.clock_result(probe.server_date, probe.local_time)
    assert r.status == "FAIL", r.line()
    assert "ahead of" in r.found and "15 min" in r.found


def test_clock_decision():
    date = email.utils.formatdate(1_000_000.0, usegmt=True)
    assert storage.clock_result(date, 1_000_003.0).status == "PASS"
    assert storage.clock_result(date, 1_000_000.0 - 30).status == "FAIL"
    assert storage.clock_result(None, 0.0).status == "SKIP"


def test_writable_directory_passes(tmp_path):
    r = storage.store_result(storage.probe_store(f"file://{tmp_path}/r1"))
    assert r.status == "PASS", r.line()
    scratch = tmp_path / "r1" / ".doctor"
    assert not scratch.exists() or os.listdir(scratch) == []  # the store removes emptied directories


def test_unwritable_directory_fails(tmp_path):
    (tmp_path / "file").write_text("not a directory")  # root ignores modes; a file in the path stops anyone
    r = storage.store_result(storage.probe_store(f"file://{tmp_path}/file/r1"))
    assert r.status == "FAIL" and "cannot write" in r.found, r.line()
