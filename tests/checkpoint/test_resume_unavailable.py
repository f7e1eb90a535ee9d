"""Resume from S3 when the store does not answer: the real trainer, a real S3 server
(moto) and the fault proxy answering 503 SlowDown to every blob GET.

A checkpoint that could not be read proves nothing about itself: resume must stop
with one clear error (torchrun restarts the worker later) and retire nothing, and
``ckpt verify`` must say it could not verify rather than that the checkpoint failed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from elastic_ft import worker
from elastic_ft.checkpoint.reader import list_manifests
from elastic_ft.checkpoint.s3 import S3Store
from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, cli, explain, process_env

try:
    from .s3_servers import FAST_S3_OPTIONS
except ImportError:
    from s3_servers import FAST_S3_OPTIONS


def test_blob_reads_failing_with_503_stop_resume_and_retire_nothing(s3_env, s3_servers, fault_proxy, tmp_path, capsys):
    endpoint = s3_servers.get("moto")
    s3_env(endpoint)
    base = f"s3://{endpoint.bucket}/resume-unavailable/{tmp_path.name}"
    logs = str(tmp_path / "logs")
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", base, "--log_dir", logs,
            "checkpoint.every_steps=2", "checkpoint.keep_last=null"]
    assert worker.main([*args, "steps=6"]) == 0
    direct = S3Store.from_uri(f"{base}/run", **{**FAST_S3_OPTIONS, "endpoint_url": endpoint.endpoint_url})
    before = [o.key for o in direct.list()]
    assert [i.key for i in list_manifests(direct)][-1].endswith("000000000006.json")

    proxy = fault_proxy(endpoint)
    s3_env(endpoint, endpoint_url=proxy.url)
    proxy.add("slowdown", method="GET", path=r"/blobs/", times=10**6)
    capsys.readouterr()
    # Short backoffs (the spec's own settings): the attempts all fail alike, only sooner.
    assert worker.main([*args, "steps=8", "checkpoint.s3.backoff_initial=0.01", "checkpoint.s3.backoff_max=0.05"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("elastic_ft: error: ")]
    assert len(err) == 1 and "step 6 could not be read" in err[0] and "nothing was retired" in err[0], err
    assert any(s.fault == "slowdown" for s in proxy.seen)
    # The run's events (events/) grew by the failed attempt's claim and its shipped events, and its writer
    # lease (lease/) by the attempt's generation; nothing else changed.
    after = [o.key for o in direct.list()]
    kept = ("events/", "lease/")
    assert [k for k in after if not k.startswith(kept)] == [k for k in before if not k.startswith(kept)], \
        "a checkpoint was retired or deleted on a store fault"
    assert "events/attempts/00000002.json" in after and any(k.startswith("events/00000002-") for k in after)
    assert [e["event"] for e in read_events(os.path.join(logs, "events.jsonl"))].count("resume_plan") == 1

    env = process_env(AWS_ENDPOINT_URL_S3=proxy.url)
    # Both read only, and each spends most of its time in the default backoff between 503s: run them together.
    with ThreadPoolExecutor(max_workers=2) as pool:
        verifying = pool.submit(cli, "ckpt", "verify", f"{base}/run", env=env)
        exporting = pool.submit(cli, "export", f"{base}/run", "--out", str(tmp_path / "out"), env=env)
        verify, export = verifying.result(), exporting.result()
    assert verify.returncode == 2 and "FAILED" not in verify.stderr, explain(verify)
    assert "could not be read, so it was not verified" in verify.stderr and "Traceback" not in verify.stderr
    assert export.returncode == 2 and "step 6 could not be read" in export.stderr, explain(export)
    assert [o.key for o in direct.list()] == after
    direct.close()
