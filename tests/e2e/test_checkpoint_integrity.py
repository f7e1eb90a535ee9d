"""Torn and corrupted checkpoints are never loaded; resume falls back with a logged
reason; `elastic-ft ckpt verify` names the bad blob. Real files, real trainer."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from elastic_ft.checkpoint.reader import list_manifests, load_newest, read_manifest
from elastic_ft.checkpoint.store import LocalStore
from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot
from elastic_ft.events import read_events
from tests.conftest import cli, explain
from tests.e2e.conftest import train


@pytest.fixture
def run_copy(committed_run, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(committed_run, dst)
    return dst


def newest_blob_path(root: str, run_id: str, name: str) -> str:
    store = LocalStore(os.path.join(root, run_id))
    manifest = read_manifest(store, list_manifests(store)[-1].key)
    return os.path.join(root, run_id, manifest.blobs[name].key)


def test_blobs_without_manifest_are_invisible(tmp_path):
    store = LocalStore(str(tmp_path / "r"))
    writer = CheckpointWriter(store, "r")
    import torch

    def snap(step):
        return snapshot(step, step * 4, {"model": {"w": torch.full((3,), float(step))}},
                        documents={"trainer": {"step": step}}, config_hash="h")

    writer.commit(snap(1))

    class Crash(Exception):
        pass

    def crash():
        raise Crash()

    with pytest.raises(Crash):
        writer.commit(snap(2), before_manifest=crash)
    assert any("/000000000002-" in o.key for o in store.list("blobs/")), "the torn save wrote no blob"
    loaded, skipped = load_newest(store, "r")
    assert loaded.manifest.step == 1 and skipped == []
    assert loaded.tensors["model"]["w"].tolist() == [1.0, 1.0, 1.0]


def test_altered_blob_is_named_by_verify_and_skipped_on_resume(run_copy):
    path = newest_blob_path(run_copy, "run", "model")
    with open(path, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    verify = cli("ckpt", "verify", f"file://{run_copy}/run")
    assert verify.returncode == 1, explain(verify)
    assert os.path.basename(path) in verify.stderr and "sha256" in verify.stderr

    assert train(run_copy, "run", "steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=null") == 0
    events = read_events(os.path.join(run_copy, "run", "logs", "events.jsonl"))
    plan = [e for e in events if e["event"] == "resume_plan"][-1]
    assert plan["step"] == 4, "resume did not fall back past the altered checkpoint"
    assert plan["skipped"][0]["step"] == 6 and "sha256" in plan["skipped"][0]["reason"]
    assert [e["step"] for e in events if e["event"] == "step"][-4:] == [5, 6, 7, 8]
    # The bad checkpoint was retired (kept for inspection), and step 6 committed anew.
    quarantined = os.listdir(os.path.join(run_copy, "run", "quarantine"))
    assert len(quarantined) == 1 and quarantined[0].startswith("000000000006-")
    verify = cli("ckpt", "verify", f"file://{run_copy}/run", "--step", "6")
    assert verify.returncode == 0, explain(verify)


def test_missing_blob_falls_back(run_copy):
    os.unlink(newest_blob_path(run_copy, "run", "optimizer"))
    loaded, skipped = load_newest(LocalStore(os.path.join(run_copy, "run")), "run")
    assert loaded.manifest.step == 4
    assert skipped[0].step == 6 and "does not exist" in skipped[0].reason


def test_truncated_manifest_write_leaves_previous_checkpoint(run_copy):
    # A crash during the manifest's own write leaves only a temp file, which is no manifest.
    run_dir = os.path.join(run_copy, "run", "manifests")
    with open(os.path.join(run_dir, ".tmp-crash.part"), "w") as f:
        f.write('{"format": "elastic_ft.checkpoint/1", "step": 8')
    loaded, _ = load_newest(LocalStore(os.path.join(run_copy, "run")), "run")
    assert loaded.manifest.step == 6
    manifest = json.loads(open(os.path.join(run_dir, "000000000006.json")).read())
    assert set(manifest["blobs"]) == {"model", "optimizer", "trainer", "spec"}
