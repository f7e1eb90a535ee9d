"""Sharded (FSDP2/DCP) checkpoints on the ObjectStore: the metadata's JSON codec, a one-process
save and load, and real torchrun jobs that save at 2 ranks and load at 3 and at 1 (resharding),
on the filesystem and on S3 (SeaweedFS)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

import elastic_ft.checkpoint.dcp_metadata as dcp_metadata
from elastic_ft.checkpoint.dcp_metadata import (
    MetadataCorrupt, Stored, check_locations, decode_metadata, encode_metadata, verify_metadata,
)
from elastic_ft.checkpoint.errors import BlobMismatch, StoreUnavailable
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.manifest import BlobRef
from elastic_ft.checkpoint.reader import list_manifests, load_newest, read_manifest, verify
from elastic_ft.checkpoint.retention import RetentionPolicy, collect
from elastic_ft.checkpoint.saver import AsyncSaver
from elastic_ft.checkpoint.save_errors import SaveFailed
from elastic_ft.checkpoint.sharded import is_sharded, load_sharded, load_sharded_full, save_sharded, stage
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot
from tests.checkpoint.s3_servers import aws_env, make_s3_store
from tests.conftest import REPO, explain, process_env

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_ranks.py")


# --------------------------------------------------------------------------- the metadata codec


def _metadata() -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
              ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 4]))]
    w = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([5, 4]), chunks)
    step = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]),
                                 [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    storage = {MetadataIndex("model.w", [0, 0]): Stored("sharded/data-a", 0, 24),
               MetadataIndex("model.w", [3, 0]): Stored("sharded/data-b", 64, 16),
               MetadataIndex("optimizer.w::step", []): Stored("sharded/data-a", 64, 4)}
    return Metadata({"model.w": w, "optimizer.w::step": step}, storage_data=storage, version="1",
                    planner_data={"model.w": ("model", "w"), "optimizer.w::step": ("optimizer", "w::step")})


def test_sharded_metadata_round_trips():
    md = _metadata()
    back = decode_metadata(encode_metadata(md), key="k")
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.storage_data == md.storage_data and back.planner_data == md.planner_data and back.version == "1"
    blobs = {"sharded/data-a": BlobRef("blobs/a", 68, "x"), "sharded/data-b": BlobRef("blobs/b", 80, "x")}
    check_locations(back, blobs, key="k")
    # verify_metadata (ckpt verify, a probe: no torch) checks the bytes as decode_metadata + check_locations do.
    verify_metadata(encode_metadata(md), blobs, key="k")

    def both(data: bytes, blobs) -> list:
        return [lambda: check_locations(decode_metadata(data, key="k"), blobs, key="k"),
                lambda: verify_metadata(data, blobs, key="k")]

    for check in both(encode_metadata(md), {"sharded/data-a": blobs["sharded/data-a"]}):
        with pytest.raises(MetadataCorrupt, match="stored in blob 'sharded/data-b', which its manifest does not list"):
            check()
    for check in both(encode_metadata(md), {**blobs, "sharded/data-b": BlobRef("blobs/b", 79, "x")}):
        with pytest.raises(MetadataCorrupt, match=r"spans bytes 64\.\.80 of blob 'blobs/b', which has 79"):
            check()
    # A size its chunks do not fill: whole, it would be allocated at that size by load_sharded_full.
    for check in both(_mutated(lambda d: d["tensors"]["model.w"].update(size=[1 << 30, 4])), blobs):
        with pytest.raises(MetadataCorrupt, match=r"describes tensors of 8,589,934,596 bytes in all, more than "
                                                  r"its blobs hold \(148\)"):
            check()


def _mutated(change) -> bytes:
    doc = json.loads(encode_metadata(_metadata()))
    change(doc)
    return json.dumps(doc).encode()


def _chunk(doc):
    return doc["tensors"]["model.w"]["chunks"][0]


@pytest.mark.parametrize("data, match", [
    (b"\x80\x03}q\x00.", "is not valid JSON"),  # a pickle (what torch's FileSystemWriter writes)
    (b"[" * 9 + b"]" * 9, "nests deeper than 8 levels"),
    (b'{"format": "other"}', "has format 'other', not 'elastic_ft.dcp-metadata/1'"),
    (_mutated(lambda d: d["tensors"]["model.w"].update(dtype="F33")), "unknown dtype 'F33'"),
    (_mutated(lambda d: d["tensors"]["model.w"].update(size=[5, -4])), r"has size \[5, -4\]"),
    (_mutated(lambda d: _chunk(d).update(sizes=[3, 5])), r"reaches past the tensor's size \[5, 4\]"),
    (_mutated(lambda d: _chunk(d).update(offsets=[0])), "needs 'offsets' and 'sizes' of 2"),
    (_mutated(lambda d: _chunk(d).update(length=25)), "spans 25 bytes but its sizes"),
    (_mutated(lambda d: _chunk(d).update(blob="../etc")), "needs a 'blob' name under 'sharded/'"),
    (_mutated(lambda d: _chunk(d).update(offset=True)), "non-negative 'offset'"),
    (_mutated(lambda d: d["tensors"]["model.w"]["chunks"].append(_chunk(d))), r"has two chunks at \[0, 0\]"),
    (_mutated(lambda d: d["planner_data"].update(x=["model"])), "planner_data of 'x'"),
])
def test_sharded_metadata_refuses_malformed(data, match):
    with pytest.raises(MetadataCorrupt, match=match) as err:
        decode_metadata(data, key="blobs/1-n/sharded-metadata.json")
    assert "'blobs/1-n/sharded-metadata.json'" in str(err.value)
    assert isinstance(err.value, BlobMismatch)  # resume counts it corrupt and falls back
    with pytest.raises(MetadataCorrupt, match=match):  # and so does a verify, which builds no DCP objects
        verify_metadata(data, {}, key="blobs/1-n/sharded-metadata.json")


def test_sharded_metadata_refuses_oversized_unread(monkeypatch):
    monkeypatch.setattr(dcp_metadata, "MAX_METADATA_BYTES", 100)
    monkeypatch.setattr(json, "loads", lambda *a: pytest.fail("parsed an oversized metadata blob"))
    with pytest.raises(MetadataCorrupt, match="has 1,000 bytes, more than the 100 allowed"):
        decode_metadata(b" " * 1000, key="k")


# --------------------------------------------------------------------------- one process, no process group


class FailingPuts(LocalStore):
    failing = False

    def put(self, key, data, *, if_absent=False):
        if self.failing and ("sharded-data-" in key or "sharded-whole-" in key):
            raise StoreUnavailable(f"{self.join(key)}: connection reset")
        super().put(key, data, if_absent=if_absent)


def _state(value: float) -> dict:
    g = torch.Generator().manual_seed(int(value))
    return {"model": {"w": torch.randn(5, 4, generator=g).to(torch.bfloat16), "b": torch.full((3,), value)},
            "optimizer": {"w::exp_avg": torch.randn(5, 4, generator=g), "w::step": torch.tensor(value)}}


def _snap(step: int, state: dict) -> Snapshot:
    return Snapshot(step=step, cursor=step, tensors={}, documents={"trainer": {"step": step}}, config_hash="c",
                    sharded=stage(state))


def test_sharded_save_and_load_in_one_process(tmp_path, monkeypatch):
    store = FailingPuts(str(tmp_path / "store"))
    saver = AsyncSaver(CheckpointWriter(store, "run"), part_attempts=2)
    for step in (1, 2):
        saver.save(_snap(step, _state(step)), f"n{step}")
    store.failing = True
    with pytest.raises(SaveFailed, match=r"checkpoint of step 3 not committed: sharded save of step 3 failed: "
                                         r"rank 0: StoreUnavailable: .*sharded-whole-.*connection reset"):
        saver.save(_snap(3, _state(3)), "n3")
    saver.close()
    assert [m.key for m in list_manifests(store)] == ["manifests/000000000001.json", "manifests/000000000002.json"]
    with pytest.raises(ValueError, match=r"model.lr \(float\) are not tensors; DCP would pickle them"):
        save_sharded(CheckpointWriter(store, "run"), _snap(4, {"model": {"lr": 0.1}}), "n4", None)

    # Loading unpickles nothing: not DCP's torch.load, not a pickled metadata.
    def refuse(*a, **k):
        raise AssertionError("unpickled while loading")

    dumps = pickle.dumps  # to write a pickle where the metadata should be, below
    for mod, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    loaded, skipped = load_newest(store, "run")
    assert loaded.manifest.step == 2 and is_sharded(loaded.manifest) and skipped == []
    assert loaded.tensors == {} and loaded.documents == {"trainer": {"step": 2}}
    want = _state(2)
    full = load_sharded_full(store, loaded.manifest)
    assert sorted(full) == ["model", "optimizer"]
    for group, named in want.items():
        for name, t in named.items():
            assert full[group][name].dtype == t.dtype and torch.equal(full[group][name], t), (group, name)
    target = {g: {n: torch.zeros_like(t) for n, t in named.items()} for g, named in want.items()}
    load_sharded(store, loaded.manifest, target)
    assert all(torch.equal(target[g][n], t) for g, named in want.items() for n, t in named.items())

    # A step whose metadata blob verifies but is not ours (a pickle): skipped as corrupt, naming it, unread.
    writer = CheckpointWriter(store, "run")
    foreign = writer.put_blob("blobs/000000000009-x/sharded-metadata.json", dumps({"state_dict_metadata": 1}))
    writer.commit_manifest(_snap(9, _state(9)), {**loaded.manifest.blobs, "sharded/metadata": foreign})
    newest, skipped = load_newest(store, "run")
    assert newest.manifest.step == 2 and [s.step for s in skipped] == [9]
    assert f"sharded checkpoint metadata '{foreign.key}' is not valid JSON" in skipped[0].reason
    store.delete("manifests/000000000009.json")

    # A flipped byte in a data blob: the load names it, resume falls back to step 1.
    # No process group: every tensor is whole (no DTensor), so all sit in one "whole" blob.
    data_name, data_key = next((n, r.key) for n, r in sorted(loaded.manifest.blobs.items())
                               if n.startswith("sharded/whole-"))
    path = tmp_path / "store" / data_key
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(BlobMismatch, match=f"blob '{data_key}' has sha256"):
        load_sharded(store, loaded.manifest, target)
    assert [p.split(":")[0] for p in verify(store, loaded.manifest)] == [data_name]
    older, skipped = load_newest(store, "run")
    assert older.manifest.step == 1 and [s.step for s in skipped] == [2] and data_key in skipped[0].reason


# --------------------------------------------------------------------------- torchrun: 2 ranks save, 3 and 1 load


def _torchrun(nproc: int, *args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT, *args]
    env = env or process_env(PYTHONPATH=REPO, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)


def _ranks(out, mode: str, world: int) -> dict:
    results = [json.loads((out / f"{mode}-{world}-rank{r}.json").read_text()) for r in range(world)]
    assert all(r == results[0] for r in results[1:]), "the ranks saw different outcomes"
    return results[0]


def _check_saves(out, world: int = 2) -> None:
    ranks = [json.loads((out / f"save-{world}-rank{r}.json").read_text()) for r in range(world)]
    r0 = ranks[0]
    assert [r["commit"] for r in ranks] == ["ok"] * world
    blobs = r0["commit_blobs"]
    assert "sharded/metadata" in blobs and blobs[-1] == "trainer"
    # One data blob per rank; the optimizer's whole ``step`` tensors, dealt to some ranks, in small blobs of their own.
    assert len([b for b in blobs if b.startswith("sharded/data-")]) == world
    assert 1 <= len([b for b in blobs if b.startswith("sharded/whole-")]) <= world and len(blobs) <= 2 + 2 * world
    for key in ("failing_put", "nan", "paired"):
        assert len({str(r[key]) for r in ranks}) == 1, f"{key}: the ranks decided differently"
    assert r0["failing_put"].startswith("SaveFailed: checkpoint of step 2 not committed: sharded save of step 2 "
                                        "failed: rank 1: StoreUnavailable")
    assert "connection reset (this rank only)" in r0["failing_put"] and ranks[1]["failed_puts"] == 2  # retried once
    assert r0["nan"].startswith("SavesFailing: checkpoint of step 3 refused") and "rank 1/2: non-finite" in r0["nan"]
    assert r0["paired"] == world


def _check_full(store, out) -> dict:
    expected = load_file(str(out / "expected.safetensors"))
    (loaded, skipped) = load_newest(store, "sharded")
    assert loaded.manifest.step == 1 and skipped == [] and loaded.documents["trainer"]["step"] == 1
    full = load_sharded_full(store, loaded.manifest)
    assert sorted(f"{g}/{n}" for g, named in full.items() for n in named) == sorted(expected)
    for key, t in expected.items():
        group, name = key.split("/", 1)
        assert torch.equal(full[group][name], t), key
    return expected


@pytest.mark.torchrun
@pytest.mark.slow
def test_sharded_fsdp_saved_at_2_loads_at_3_and_1(tmp_path):
    out, root = tmp_path / "out", tmp_path / "store"
    out.mkdir()
    _torchrun(2, "save", str(root), str(out))
    _check_saves(out)
    store = LocalStore(str(root))
    assert [m.key for m in list_manifests(store)] == ["manifests/000000000001.json"]
    expected = _check_full(store, out)
    manifest = read_manifest(store, "manifests/000000000001.json")
    # gc keeps every blob of the checkpoint; the failed saves' blobs are orphans, collected after the grace.
    plan = collect(store, RetentionPolicy(keep_last=1, orphan_grace_s=0), now=2e9, run_id="sharded")
    deleted = {d.key for d in plan.blobs}
    assert not deleted & {r.key for r in manifest.blobs.values()} and deleted
    assert all(k.startswith(("blobs/000000000002-", "blobs/000000000003-")) for k in deleted)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(root, corrupt)
    data_key = next(r.key for n, r in sorted(manifest.blobs.items()) if n.startswith("sharded/data-"))
    raw = bytearray((corrupt / data_key).read_bytes())
    raw[7] ^= 0x10
    (corrupt / data_key).write_bytes(bytes(raw))
    _torchrun(3, "load", str(root), str(out), str(corrupt))
    _torchrun(1, "load", str(root), str(out))
    r3, r1 = _ranks(out, "load", 3), _ranks(out, "load", 1)
    assert r3["load"] == r1["load"] == "ok" and r3["params_are_loaded"] and r1["params_are_loaded"]
    assert r3["corrupt"].startswith(f"BlobMismatch: blob '{data_key}' has sha256")
    for world in (3, 1):
        loaded = load_file(str(out / f"loaded-{world}.safetensors"))
        assert sorted(loaded) == sorted(expected)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), f"world {world} loaded other values"


@pytest.mark.torchrun
@pytest.mark.slow
def test_sharded_fsdp_save_and_load_on_s3(tmp_path, s3_env, s3_servers):
    endpoint = s3_servers.get("seaweedfs")
    s3_env(endpoint)
    store, prefix = make_s3_store(endpoint)
    out = tmp_path / "out"
    out.mkdir()
    env = aws_env(process_env(PYTHONPATH=REPO, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1"),
                  endpoint, str(tmp_path))
    try:
        _torchrun(2, "save", f"s3://{endpoint.bucket}/{prefix.rstrip('/')}", str(out), env=env)
        _check_saves(out)
        assert [m.key for m in list_manifests(store)] == ["manifests/000000000001.json"]
        _check_full(store, out)
    finally:
        store.close()
