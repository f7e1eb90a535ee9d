"""The node-local checkpoint cache (elastic_ft.checkpoint.cache): verified copies, the store in charge.

Real filesystem stores on both sides; the trainer's use of it is the last test
(a resumed run whose store lost the blobs loads them from the node's cache,
and a tampered copy is read from the store instead).
"""

from __future__ import annotations

import glob
import os
import shutil
import threading

import pytest

from elastic_ft.checkpoint.cache import KEEP_STEPS, CachedStore
from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.errors import BlobMismatch, ObjectNotFound
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.runevents.events import read_events
from tests.e2e.conftest import train


@pytest.fixture
def stores(tmp_path):
    remote = LocalStore(str(tmp_path / "remote"))
    return remote, CachedStore(remote, str(tmp_path / "cache")), tmp_path / "cache"


def ref(data: bytes) -> dict:
    return {"size": len(data), "sha256": blob_sha256(data, 0), "chunk_size": 0}


def test_a_written_blob_is_read_back_from_the_cache(stores):
    remote, cached, cache_dir = stores
    data = b"tensor bytes" * 100
    cached.put("blobs/000000000004-ab/model.safetensors", data)
    remote.delete("blobs/000000000004-ab/model.safetensors")  # only the node's copy is left
    assert bytes(cached.get_verified("blobs/000000000004-ab/model.safetensors", **ref(data))) == data
    assert cached.hits == 1


def test_manifests_are_never_cached(stores):
    remote, cached, cache_dir = stores
    cached.put("manifests/000000000004.json", b"{}", if_absent=True)
    remote.delete("manifests/000000000004.json")
    with pytest.raises(ObjectNotFound):
        cached.get("manifests/000000000004.json")
    assert not (cache_dir / "manifests").exists()


def test_an_altered_copy_is_read_from_the_store_and_replaced(stores):
    remote, cached, cache_dir = stores
    key, data = "blobs/000000000002-cd/optimizer.safetensors", b"x" * 4096
    cached.put(key, data)
    copy = cache_dir / key
    copy.write_bytes(b"y" * 4096)  # same size, other bytes: only the digest tells
    assert bytes(cached.get_verified(key, **ref(data))) == data and cached.hits == 0
    assert copy.read_bytes() == data
    copy.write_bytes(b"short")
    assert bytes(cached.get_verified(key, **ref(data))) == data and cached.hits == 0


def test_a_blob_the_store_does_not_match_is_not_served_from_anywhere(stores):
    remote, cached, cache_dir = stores
    key, data = "blobs/000000000002-cd/model.safetensors", b"z" * 100
    cached.put(key, data)
    wrong = ref(b"w" * 100)  # the manifest records other bytes than both copies hold
    with pytest.raises(BlobMismatch):
        cached.get_verified(key, **wrong)


def test_the_last_checkpoints_are_kept_and_older_ones_dropped(stores):
    remote, cached, cache_dir = stores
    for step in range(1, KEEP_STEPS + 3):
        cached.put(f"blobs/{step:012d}-n/model.safetensors", b"m" * step)
        os.utime(cache_dir / "blobs" / f"{step:012d}-n", (step, step))  # distinct ages on coarse clocks
    kept = sorted(os.listdir(cache_dir / "blobs"))
    assert len(kept) == KEEP_STEPS and kept[-1] == f"{KEEP_STEPS + 2:012d}-n"


def test_blobs_put_from_several_threads_keep_the_newest_steps(tmp_path):
    """The saver puts a checkpoint's blobs from several threads, each pruning old steps: a prune that
    deleted in place made a half-deleted step look newest to the next, which then dropped the steps
    meant to stay (seen: the whole cache gone after a save)."""
    names = [f"part{i}.safetensors" for i in range(6)]
    for attempt in range(15):
        remote = LocalStore(str(tmp_path / f"remote{attempt}"))
        cache_dir = tmp_path / f"cache{attempt}"
        cached = CachedStore(remote, str(cache_dir))
        for step in (2, 4):
            for name in names:
                cached.put(f"blobs/{step:012d}-n/{name}", b"o" * 64)
            os.utime(cache_dir / "blobs" / f"{step:012d}-n", (step, step))  # distinct ages on coarse clocks
        barrier = threading.Barrier(len(names))

        def put(name: str) -> None:
            barrier.wait()
            cached.put(f"blobs/000000000006-n/{name}", b"n" * 4096)

        threads = [threading.Thread(target=put, args=(name,)) for name in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(os.listdir(cache_dir / "blobs")) == ["000000000004-n", "000000000006-n"], attempt
        assert sorted(os.listdir(cache_dir / "blobs" / "000000000006-n")) == sorted(names), attempt
        assert sorted(os.listdir(cache_dir / "blobs" / "000000000004-n")) == sorted(names), attempt


@pytest.mark.slow  # trains in this process: over 10 s on 2 cores
def test_a_resumed_run_loads_from_the_node_cache_and_never_trusts_a_bad_copy(tmp_path):
    root, cache = str(tmp_path / "runs"), str(tmp_path / "cache")
    args = ["checkpoint.every_steps=2", "checkpoint.keep_last=null", f"checkpoint.local_cache_dir={cache}"]
    assert train(root, "run", "steps=4", *args) == 0
    blobs = sorted(glob.glob(os.path.join(root, "run", "blobs", "000000000004-*")))
    assert len(blobs) == 1 and os.listdir(os.path.join(cache, "run", "blobs"))
    saved = str(tmp_path / "saved")
    shutil.move(blobs[0], saved)  # the store lost step 4's blobs: only this node's cache holds them
    assert train(root, "run", "steps=6", *args) == 0
    events = read_events(os.path.join(root, "run", "logs", "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "resume_plan"] == [0, 4]

    # A tampered copy is not loaded: step 6's blobs are read from the store, and the copy replaced.
    cached6 = glob.glob(os.path.join(cache, "run", "blobs", "000000000006-*", "*.safetensors"))
    assert cached6
    for path in cached6:
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    assert train(root, "run", "steps=8", *args) == 0
    events = read_events(os.path.join(root, "run", "logs", "events.jsonl"))
    plans = [e for e in events if e["event"] == "resume_plan"]
    assert [p["step"] for p in plans] == [0, 4, 6] and plans[-1]["skipped"] == []
    assert events[-1]["event"] == "end" and events[-1]["step"] == 8
