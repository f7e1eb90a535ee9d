"""Several workers of one node resolving the same input at once: one download, every reader a complete file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from tests.conftest import REPO, process_env
from tests.waiting import wait_until

MiB = 1 << 20


def test_workers_starting_together_download_once_and_read_complete_files(remote, tmp_path):
    body = os.urandom(24 * MiB)  # several chunks, so a reader racing the writer would see a part
    remote.put("big.jsonl", body)
    uri, go = remote.uri("big.jsonl"), str(tmp_path / "go")
    child = os.path.join(os.path.dirname(__file__), "fetch_child.py")
    env = process_env(PYTHONPATH=REPO)
    ready = [str(tmp_path / f"ready-{i}") for i in range(3)]
    procs = [subprocess.Popen([sys.executable, child, remote.cache_dir, uri, r, go], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    wait_until(lambda: all(map(os.path.exists, ready)), timeout=120, what="every worker ready to resolve")
    open(go, "w").close()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(len(r["fetched"]) for r in results) == [0, 0, 1], results
    assert {r["sha256"] for r in results} == {hashlib.sha256(body).hexdigest()}
    # One download: each byte range of the object asked for once (ranged GETs of 8 MiB, the default part).
    gets = [g for g in remote.proxy.seen if g.method == "GET" and g.path.split("?")[0].endswith("/big.jsonl")]
    spans = [tuple(int(v) for v in g.range.removeprefix("bytes=").split("-")) for g in gets]
    assert len(set(spans)) == len(spans) and sum(b - a + 1 for a, b in spans) == len(body), spans
