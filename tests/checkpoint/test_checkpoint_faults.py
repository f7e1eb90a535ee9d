"""Whole checkpoints under faults: the real CheckpointWriter, AsyncSaver and reader
against real S3 servers, through the fault proxy.

Each case ends with the invariant the commit protocol exists for: every
committed manifest's blobs exist with the recorded size and sha256, read
directly from the server (never through the proxy). A manifest that pointed at
a missing or partial blob would be a checkpoint that cannot be resumed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.manifest import MANIFEST_PREFIX, ManifestForeign, manifest_key
from elastic_ft.checkpoint.reader import list_manifests, load_newest, read_manifest
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.save_errors import SaveFailed
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.store import ObjectStore, StoreUnavailable
from elastic_ft.checkpoint.writer import CheckpointConflict, CheckpointWriter, new_nonce, snapshot
from tests.conftest import cli, explain, process_env
from tests.waiting import wait_until

from elastic_ft.checkpoint.s3 import S3Store

try:
    from .s3_servers import FAST_S3_OPTIONS, S3_BACKENDS, make_s3_store
except ImportError:
    from s3_servers import FAST_S3_OPTIONS, S3_BACKENDS, make_s3_store

RUN = "faulty"


def make_snap(step: int, *, model_numel: int = 1536 * 1024):
    """A checkpoint-shaped snapshot: a 6 MiB model blob (multipart at the test stores'
    5 MiB threshold), a small optimizer blob and a JSON document; values depend on step."""
    gen = torch.Generator().manual_seed(step)
    tensors = {
        "model": {"w": torch.randn(model_numel, generator=gen), "b": torch.full((64,), float(step))},
        "optimizer": {"w::exp_avg": torch.randn(4096, generator=gen)},
    }
    return snapshot(step, step * 8, tensors, documents={"trainer": {"step": step}}, config_hash="cfg")


def assert_committed_blobs_intact(store: ObjectStore, *, run_id: str = RUN) -> list[int]:
    """Every committed manifest's blobs exist with the recorded size and sha256; the committed steps."""
    steps = []
    for info in list_manifests(store):
        manifest = read_manifest(store, info.key, run_id=run_id)
        for name, ref in manifest.blobs.items():
            data = store.get(ref.key)
            assert len(data) == ref.size, f"step {manifest.step} blob {name}: {len(data)} bytes, recorded {ref.size}"
            assert blob_sha256(data, ref.chunk_size) == ref.sha256, f"step {manifest.step} blob {name}: sha256 differs"
        steps.append(manifest.step)
    return steps


def requests(proxy, method: str, pattern: str):
    return [s for s in proxy.seen if s.method == method and pattern in s.path]


class Proxied:
    """A store through the fault proxy, and the same root read directly from the server."""

    def __init__(self, endpoint, proxy):
        self.endpoint, self.proxy = endpoint, proxy
        self._stores: list[S3Store] = []
        self.store, self.prefix = make_s3_store(endpoint)  # endpoint from the environment: the proxy
        self.uri = f"s3://{endpoint.bucket}/{self.prefix.rstrip('/')}"
        self.direct = self.another(endpoint_url=endpoint.endpoint_url)

    def another(self, **options) -> S3Store:
        """Another store on the same root (another writer or reader); through the proxy by default."""
        store = S3Store.from_uri(self.uri, **{**FAST_S3_OPTIONS, **options})
        self._stores.append(store)
        return store

    def close(self) -> None:
        for s in [self.store, *self._stores]:
            s.close()


def _proxied(name, s3_env, s3_servers, fault_proxy):
    endpoint = s3_servers.get(name)
    proxy = fault_proxy(endpoint)
    s3_env(endpoint, endpoint_url=proxy.url)
    return Proxied(endpoint, proxy)


@pytest.fixture(params=S3_BACKENDS)
def s3ckpt(request, s3_env, s3_servers, fault_proxy):
    p = _proxied(request.param, s3_env, s3_servers, fault_proxy)
    yield p
    p.close()


@pytest.fixture
def seaweed(s3_env, s3_servers, fault_proxy):
    p = _proxied("seaweedfs", s3_env, s3_servers, fault_proxy)
    yield p
    p.close()


# --------------------------------------------------------------------------- faults during a save


class TestSaveUnderFaults:
    def test_slowdown_during_blob_upload_still_commits(self, s3ckpt, caplog):
        p = s3ckpt
        p.proxy.add("slowdown", method="PUT", path="blobs/000000000001-", times=3)
        with caplog.at_level(logging.WARNING, logger="elastic_ft.checkpoint.s3"):
            manifest = CheckpointWriter(p.store, RUN).commit(make_snap(1))
        assert sum(s.fault == "slowdown" for s in p.proxy.seen) == 3
        assert sum("SlowDown" in r.getMessage() for r in caplog.records) == 3
        assert assert_committed_blobs_intact(p.direct) == [1]
        assert read_manifest(p.direct, manifest.key).writer == manifest.writer

    def test_connection_dropped_before_forwarding_still_commits(self, s3ckpt):
        p = s3ckpt
        p.proxy.add("drop_before", method="PUT", path="optimizer.safetensors")
        p.proxy.add("drop_before", method="PUT", path=MANIFEST_PREFIX)
        CheckpointWriter(p.store, RUN).commit(make_snap(1))
        assert [s.fault for s in requests(p.proxy, "PUT", MANIFEST_PREFIX)] == ["drop_before", None]
        assert assert_committed_blobs_intact(p.direct) == [1]

    def test_lost_answer_to_manifest_put_is_recognised_as_our_own_commit(self, s3ckpt, caplog):
        # The server committed the manifest, the answer was lost, the retry got 412:
        # the writer re-reads the manifest, finds its own token and reports success.
        p = s3ckpt
        writer = CheckpointWriter(p.store, RUN)
        p.proxy.add("drop_after", method="PUT", path=manifest_key(1))
        with caplog.at_level(logging.INFO, logger="elastic_ft.checkpoint.writer"):
            manifest = writer.commit(make_snap(1))
        puts = requests(p.proxy, "PUT", manifest_key(1))
        assert [s.fault for s in puts] == ["drop_after", None], "the ambiguous case did not happen"
        assert any("already committed by this writer" in r.getMessage() for r in caplog.records)
        assert [o.key for o in list_manifests(p.direct)] == [manifest_key(1)]  # committed exactly once
        stored = read_manifest(p.direct, manifest_key(1), run_id=RUN)
        assert stored.writer == writer.writer_token and stored.blobs == manifest.blobs
        assert assert_committed_blobs_intact(p.direct) == [1]

    def test_slow_manifest_put_past_the_read_timeout_commits_once(self, s3ckpt):
        # The delayed PUT reaches the server after the client gave up and retried:
        # whichever lands first, the manifest is ours and there is one.
        p = s3ckpt
        store = p.another(read_timeout=1)
        writer = CheckpointWriter(store, RUN)
        p.proxy.add("delay", method="PUT", path=manifest_key(1), seconds=2)
        writer.commit(make_snap(1))
        assert [s.fault for s in requests(p.proxy, "PUT", manifest_key(1))][0] == "delay"
        assert read_manifest(p.direct, manifest_key(1), run_id=RUN).writer == writer.writer_token
        assert assert_committed_blobs_intact(p.direct) == [1]

    def test_async_saver_retries_a_failed_part_then_commits(self, s3ckpt):
        # The store gives up on the optimizer blob after its 4 attempts; the saver
        # retries the whole part and the checkpoint commits.
        p = s3ckpt
        committed = []
        saver = AsyncSaver(CheckpointWriter(p.store, RUN), on_commit=lambda m, s: committed.append(m.step))
        p.proxy.add("slowdown", method="PUT", path="optimizer.safetensors", times=4)
        saver.save(make_snap(2), new_nonce())
        assert committed == [2]
        assert sum(s.fault == "slowdown" for s in p.proxy.seen) == 4
        assert assert_committed_blobs_intact(p.direct) == [2]

    def test_async_saver_that_cannot_upload_fails_cleanly(self, s3ckpt):
        p = s3ckpt
        errors = []
        saver = AsyncSaver(CheckpointWriter(p.store, RUN), on_error=lambda s, e: errors.append((s.step, e)),
                           part_attempts=2)
        CheckpointWriter(p.store, RUN).commit(make_snap(1))
        p.proxy.add("slowdown", method="PUT", path="blobs/000000000002-", times=1000)
        saver.submit(make_snap(2), new_nonce())
        with pytest.raises(SaveFailed, match=r"checkpoint of step 2 not committed after 2 attempt\(s\) per part"):
            saver.flush()
        assert [step for step, _ in errors] == [2]
        assert p.direct.list(manifest_key(2)) == []
        assert assert_committed_blobs_intact(p.direct) == [1]


# --------------------------------------------------------------------------- faults during a load


class TestLoadUnderFaults:
    def test_truncated_download_is_retried_and_never_loaded(self, s3ckpt):
        p = s3ckpt
        writer = CheckpointWriter(p.store, RUN)
        writer.commit(make_snap(1))
        m2 = writer.commit(make_snap(2))
        model_key = m2.blobs["model"].key
        # Twice truncated, then whole: the load retries and gets step 2 intact.
        p.proxy.add("truncate", method="GET", path=model_key, times=2, keep=1000)
        loaded, skipped = load_newest(p.store, RUN)
        assert sum(s.fault == "truncate" for s in p.proxy.seen) == 2
        assert skipped == [] and loaded.manifest.step == 2
        torch.testing.assert_close(loaded.tensors["model"]["w"], make_snap(2).tensors["model"]["w"])

    def test_always_truncated_download_is_unavailable_not_corrupt(self, s3ckpt):
        # Retries ran out on a network fault: nothing is known about checkpoint 2, so
        # the load stops rather than fall back (falling back would retire a good one).
        p = s3ckpt
        writer = CheckpointWriter(p.store, RUN)
        writer.commit(make_snap(1))
        m2 = writer.commit(make_snap(2))
        p.proxy.add("truncate", method="GET", path=m2.blobs["model"].key, times=1000, keep=1000)
        with pytest.raises(StoreUnavailable, match="step 2 could not be read") as info:
            load_newest(p.store, RUN)
        assert m2.blobs["model"].key in str(info.value)
        assert assert_committed_blobs_intact(p.direct) == [1, 2]  # nothing on the server was harmed

    def test_slow_download_still_loads(self, s3ckpt):
        p = s3ckpt
        m = CheckpointWriter(p.store, RUN).commit(make_snap(3))
        p.proxy.add("delay", method="GET", path=m.blobs["optimizer"].key, seconds=0.5)
        loaded, skipped = load_newest(p.store, RUN)
        assert skipped == [] and loaded.manifest.step == 3
        assert [s.fault for s in requests(p.proxy, "GET", m.blobs["optimizer"].key)] == ["delay"]


# --------------------------------------------------------------------------- racing writers


@pytest.fixture(params=["file", pytest.param("moto", marks=pytest.mark.skip(
    reason="moto's conditional put is not atomic: two racing IfNoneMatch='*' puts can both succeed")), "seaweedfs"])
def race_store(request, tmp_path, s3_env, s3_servers):
    if request.param == "file":
        yield LocalStore(str(tmp_path / RUN))
        return
    endpoint = s3_servers.get(request.param)
    s3_env(endpoint)
    store, _ = make_s3_store(endpoint)
    yield store
    store.close()


def test_two_writers_racing_for_one_step_exactly_one_commits(race_store):
    writers = [CheckpointWriter(race_store, RUN, writer_token=f"writer-{i}") for i in range(2)]
    for step in range(1, 6):
        snap = make_snap(step, model_numel=1024)
        parts = [w.upload_part(snap, new_nonce(), part=0, parts=1) for w in writers]
        barrier = threading.Barrier(2)
        outcomes: list = [None, None]

        def commit(i: int) -> None:
            barrier.wait()
            try:
                outcomes[i] = writers[i].commit_manifest(snap, parts[i])
            except CheckpointConflict as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
        assert len(winners) == 1, f"step {step}: outcomes {outcomes}"
        loser = outcomes[1 - winners[0]]
        assert isinstance(loser, CheckpointConflict)
        message = str(loser)
        assert f"step {step} of run '{RUN}' was already committed by writer 'writer-{winners[0]}'" in message
        assert "give each job its own run_id" in message
        stored = read_manifest(race_store, manifest_key(step), run_id=RUN)
        assert stored.writer == f"writer-{winners[0]}" and stored.blobs == parts[winners[0]]
    assert assert_committed_blobs_intact(race_store) == [1, 2, 3, 4, 5]


def test_format_1_checkpoint_is_refused_as_an_unsupported_format(race_store):
    # Format 1 (whole-blob digests) is written by no elastic_ft since format 2: a run that holds one
    # stops with one line naming it (nothing is retired or deleted), rather than training from scratch.
    snap = make_snap(3)
    m = CheckpointWriter(race_store, RUN).commit(snap)
    old = json.loads(m.to_json())
    old["format"] = "elastic_ft.checkpoint/1"
    for ref in old["blobs"].values():
        del ref["chunk_size"]
        ref["sha256"] = hashlib.sha256(race_store.get(ref["key"])).hexdigest()
    race_store.delete(m.key)
    race_store.put(m.key, json.dumps(old).encode(), if_absent=True)

    with pytest.raises(ManifestForeign, match=r"'elastic_ft.checkpoint/1', an unsupported format"):
        load_newest(race_store, RUN)
    assert [o.key for o in race_store.list(MANIFEST_PREFIX)] == [m.key]


# --------------------------------------------------------------------------- crash and corruption

CRASHING_WRITER = """
import sys, torch
from elastic_ft.checkpoint.store import open_store
from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot
store = open_store(sys.argv[1])
writer = CheckpointWriter(store, sys.argv[2])
for step in (1, 2):
    tensors = {"model": {"w": torch.full((256, 256), float(step))}, "optimizer": {"m": torch.full((4096,), float(step))}}
    writer.commit(snapshot(step, 8 * step, tensors, documents={"trainer": {"step": step}}, config_hash="cfg"))
    print("committed", step, flush=True)
"""


@pytest.mark.subprocess
def test_writer_killed_mid_upload_resume_from_previous_and_gc_removes_orphans(seaweed):
    p = seaweed
    # Checkpoint 2's optimizer blob is held in the proxy: the process is
    # mid-upload (its model blob already stored) when it is killed.
    p.proxy.add("delay", method="PUT", path=r"blobs/000000000002-.*optimizer", seconds=600)
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, p.uri, RUN], env=process_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def mid_upload() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the writer exited early ({proc.returncode}): {proc.stderr.read()}")
            landed = any(o.key.endswith("model.safetensors") for o in p.direct.list("blobs/000000000002-"))
            held = any(s.fault == "delay" for s in p.proxy.seen)
            return landed and held

        wait_until(mid_upload, timeout=120, what="the writer process uploading checkpoint 2")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    # The next job resumes from checkpoint 1: checkpoint 2 never existed.
    loaded, skipped = load_newest(p.direct, RUN)
    assert loaded.manifest.step == 1 and skipped == []
    assert torch.equal(loaded.tensors["model"]["w"], torch.full((256, 256), 1.0))
    kept = {ref.key for ref in loaded.manifest.blobs.values()}
    orphans = sorted(o.key for o in p.direct.list("blobs/000000000002-"))
    assert orphans and not set(orphans) & kept

    env = process_env(AWS_ENDPOINT_URL_S3=p.endpoint.endpoint_url)
    before = [o.key for o in p.direct.list()]
    dry = cli("ckpt", "gc", p.uri, "--grace", "0", "--dry-run", env=env)
    assert dry.returncode == 0, explain(dry)
    assert "keep checkpoints at steps [1]" in dry.stdout
    for key in orphans:
        assert f"would delete {key}  (orphan (no manifest)" in dry.stdout, dry.stdout
    assert not any(k in dry.stdout for k in kept)
    assert [o.key for o in p.direct.list()] == before, "the dry run deleted something"

    gc = cli("ckpt", "gc", p.uri, "--grace", "0", env=env)
    assert gc.returncode == 0, explain(gc)
    assert f"deleted 0 manifest(s) and {len(orphans)} blob(s)" in gc.stdout
    assert p.direct.list("blobs/000000000002-") == []
    assert {o.key for o in p.direct.list("blobs/")} == kept
    assert assert_committed_blobs_intact(p.direct) == [1]


@pytest.mark.subprocess
@pytest.mark.parametrize("blob", ["optimizer", "model"])
def test_blob_altered_after_commit_verify_names_it_and_load_falls_back(seaweed, blob):
    # The 16 KiB optimizer blob has a plain sha256; the 6 MiB model blob a
    # digest over six 1 MiB chunks, hashed in the download workers.
    p = seaweed
    writer = CheckpointWriter(p.direct, RUN)
    writer.commit(make_snap(1))
    m2 = writer.commit(make_snap(2))
    bad = m2.blobs[blob].key
    assert (m2.blobs[blob].size > m2.blobs[blob].chunk_size) == (blob == "model")
    data = bytearray(p.direct.get(bad))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the hash can tell
    p.endpoint.client().put_object(Bucket=p.endpoint.bucket, Key=p.prefix + bad, Body=bytes(data))

    env = process_env(AWS_ENDPOINT_URL_S3=p.endpoint.endpoint_url)
    verify = cli("ckpt", "verify", p.uri, env=env)
    assert verify.returncode == 1, explain(verify)
    assert "checkpoint at step 2 FAILED verification" in verify.stderr
    assert bad in verify.stderr and "sha256" in verify.stderr

    loaded, skipped = load_newest(p.direct, RUN)
    assert loaded.manifest.step == 1
    assert [s.step for s in skipped] == [2] and bad in skipped[0].reason
