"""Torn and corrupted checkpoints are never loaded; resume falls back with a logged
reason; `elastic-ft ckpt verify` names the bad blob. Real files, real trainer."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from elastic_ft.checkpoint.reader import list_manifests, load_newest, read_manifest
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot
from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, cli, explain, process_env, torchrun, tree_digest
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

    class CrashBeforeManifest(LocalStore):
        """The process dies after the blobs, as its manifest would be written."""

        def put(self, key, data, *, if_absent=False):
            if key.startswith("manifests/"):
                raise Crash()
            super().put(key, data, if_absent=if_absent)

    with pytest.raises(Crash):
        CheckpointWriter(CrashBeforeManifest(str(tmp_path / "r")), "r").commit(snap(2))
    assert any("/000000000002-" in o.key for o in store.list("blobs/")), "the torn save wrote no blob"
    loaded, skipped = load_newest(store, "r")
    assert loaded.manifest.step == 1 and skipped == []
    assert loaded.tensors["model"]["w"].tolist() == [1.0, 1.0, 1.0]


class WritableLocalStore(LocalStore):
    """Returns blobs as a writable memoryview, as the S3 store does for a large download (the zero-copy read path)."""

    def get_verified(self, key, **kwargs):
        return memoryview(bytearray(super().get_verified(key, **kwargs)))


@pytest.mark.parametrize("store_class", [LocalStore, WritableLocalStore], ids=["bytes", "writable"])
@pytest.mark.subprocess
def test_blob_with_corrupt_header_but_matching_digest_is_corrupt_and_skipped(tmp_path, monkeypatch, store_class):
    # A writer bug: the header's shape does not match the data. The manifest's digest is
    # computed over those very bytes, so only the header check can tell.
    import torch

    from elastic_ft.checkpoint import writer as writer_module
    from elastic_ft.checkpoint.codec import safetensors_segments

    root = str(tmp_path / "r")
    store = store_class(root)
    writer = CheckpointWriter(store, "r")

    def snap(step):
        return snapshot(step, step * 4, {"model": {"w": torch.full((3,), float(step))}},
                        documents={"trainer": {"step": step}}, config_hash="h")

    def buggy_segments(tensors):
        blob = safetensors_segments(tensors).tobytes()
        assert b'"shape":[3]' in blob
        return blob.replace(b'"shape":[3]', b'"shape":[9]')  # same length: the data offsets stay in place

    writer.commit(snap(1))
    monkeypatch.setattr(writer_module, "safetensors_segments", buggy_segments)
    writer.commit(snap(2))
    monkeypatch.undo()

    loaded, skipped = load_newest(store, "r")
    assert loaded.manifest.step == 1 and loaded.tensors["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    [bad] = skipped
    assert bad.step == 2 and bad.kind == "corrupt"
    assert ".safetensors" in bad.reason and "'w'" in bad.reason and "needs 36" in bad.reason, bad.reason
    verify = cli("ckpt", "verify", f"file://{root}", "--step", "2")
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, explain(verify)
    assert "model" in verify.stderr and "needs 36" in verify.stderr, explain(verify)


@pytest.mark.subprocess
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


# --------------------------------------------------------------------------- corrupt, foreign or unreadable


def manifest_path(root: str, step: int) -> str:
    return os.path.join(root, "run", "manifests", f"{step:012d}.json")


def quarantine(root: str) -> list[str]:
    qdir = os.path.join(root, "run", "quarantine")
    return sorted(os.listdir(qdir)) if os.path.isdir(qdir) else []


def resume_plans(root: str) -> list[dict]:
    return [e for e in read_events(os.path.join(root, "run", "logs", "events.jsonl")) if e["event"] == "resume_plan"]


def one_error_line(text: str) -> str:
    """The one error line the CLI or the worker ends with (log records of the run may precede it)."""
    lines = [ln for ln in text.splitlines() if re.match(r"elastic[-_]ft: error: ", ln)]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.subprocess
def test_torn_manifest_is_quarantined_and_resume_falls_back(run_copy, capsys):
    # A filesystem without atomic rename (or a truncated object) can leave a torn manifest under its real name.
    path = manifest_path(run_copy, 6)
    torn = open(path, "rb").read()[:100]
    with open(path, "wb") as f:
        f.write(torn)
    ls = cli("ckpt", "ls", f"file://{run_copy}/run")
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, explain(ls)
    assert "CORRUPT" in ls.stdout and "000000000006.json" in ls.stdout and "not valid JSON" in ls.stdout
    assert "000000000004.json" in ls.stdout
    gc = cli("ckpt", "gc", f"file://{run_copy}/run", "--dry-run")  # gc goes on past it, and says so
    assert gc.returncode == 0 and "keep checkpoints at steps [2, 4]" in gc.stdout, explain(gc)
    assert "corrupt manifest" in gc.stderr and "000000000006.json" in gc.stderr and "Traceback" not in gc.stderr

    assert train(run_copy, "run", "steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=null") == 0
    plan = resume_plans(run_copy)[-1]
    assert plan["step"] == 4 and plan["skipped"][0]["step"] == 6 and "not valid JSON" in plan["skipped"][0]["reason"]
    [retired] = quarantine(run_copy)
    record = json.load(open(os.path.join(run_copy, "run", "quarantine", retired)))
    assert retired.startswith("000000000006-") and record["manifest_text"] == torn.decode()
    assert "not valid JSON" in record["reason"]
    verify = cli("ckpt", "verify", f"file://{run_copy}/run", "--step", "6")  # step 6 committed anew
    assert verify.returncode == 0, explain(verify)


@pytest.mark.subprocess
def test_deeply_nested_manifest_is_named_not_a_traceback(run_copy, tmp_path):
    path = manifest_path(run_copy, 6)
    with open(path, "wb") as f:
        f.write(b'{"format": "elastic_ft.checkpoint/2", "run_id": "run", "x": ' + b"[" * 200_000 + b"]" * 200_000
                + b"}")
    uri = f"file://{run_copy}/run"
    ls = cli("ckpt", "ls", uri)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, explain(ls)
    assert "CORRUPT" in ls.stdout and "000000000006.json" in ls.stdout and "deeper than" in ls.stdout
    verify = cli("ckpt", "verify", uri)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, explain(verify)
    assert "000000000006.json" in verify.stderr and "deeper than" in verify.stderr
    # export reads past it (read-only: nothing retired); --step names it in one line.
    out = cli("export", uri, "--out", str(tmp_path / "out"))
    assert out.returncode == 0 and "exported step 4" in out.stdout, explain(out)
    out = cli("export", uri, "--out", str(tmp_path / "out6"), "--step", "6")
    assert out.returncode == 2 and "000000000006.json" in one_error_line(out.stderr), explain(out)
    assert "Traceback" not in out.stderr, explain(out)
    assert quarantine(run_copy) == []

    assert train(run_copy, "run", "steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=null") == 0
    assert resume_plans(run_copy)[-1]["step"] == 4
    assert [q[:12] for q in quarantine(run_copy)] == ["000000000006"]


@pytest.mark.subprocess
def test_unreadable_blob_stops_resume_and_retires_nothing(run_copy, capsys):
    # A real fault that proves nothing about the checkpoint: its blob cannot be read
    # (a directory where the file should be; EISDIR stands in for EIO, ENOMEM, ...).
    blob = newest_blob_path(run_copy, "run", "optimizer")
    os.unlink(blob)
    os.mkdir(blob)
    before = sorted(os.listdir(os.path.join(run_copy, "run", "manifests")))
    plans = len(resume_plans(run_copy))
    verify = cli("ckpt", "verify", f"file://{run_copy}/run")
    assert verify.returncode == 2 and "FAILED" not in verify.stderr, explain(verify)
    assert "could not be read" in one_error_line(verify.stderr) and "optimizer" in verify.stderr
    assert "Traceback" not in verify.stderr, explain(verify)

    capsys.readouterr()
    assert train(run_copy, "run", "steps=8", "checkpoint.every_steps=2") == 2
    err = one_error_line(capsys.readouterr().err)
    assert "step 6 could not be read" in err and "nothing was retired" in err and "Is a directory" in err
    assert sorted(os.listdir(os.path.join(run_copy, "run", "manifests"))) == before and quarantine(run_copy) == []
    assert len(resume_plans(run_copy)) == plans, "a resume was planned from a checkpoint that could not be read"


def test_changed_lora_rank_is_named_before_loading(run_copy, capsys):
    assert train(run_copy, "run", "steps=8", "lora.r=4") == 2
    captured = capsys.readouterr().err
    err = one_error_line(captured)
    assert "lora.r is 8 in the checkpoint but 4 now" in err and "--run_id" in err and "size mismatch" not in captured
    assert quarantine(run_copy) == []
    assert train(run_copy, "run", "steps=8", "lora.target_modules=[q_proj]") == 2
    assert "lora.target_modules" in one_error_line(capsys.readouterr().err)


def test_fields_that_keep_tensor_shapes_still_resume(run_copy):
    assert train(run_copy, "run", "steps=7", "optimizer.lr=1e-3", "lora.alpha=32") == 0
    plan = resume_plans(run_copy)[-1]
    assert plan["step"] == 6 and plan["config_changed"] and plan["skipped"] == []


@pytest.mark.torchrun
def test_a_rank_that_cannot_load_stops_every_rank_with_the_reason(run_copy):
    # Rank 1's read of the chosen checkpoint fails (after the leader verified it):
    # one collective tells every rank, and all stop naming rank 1 and why.
    before = tree_digest(os.path.join(run_copy, "run", "manifests"))
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{run_copy}",
            "--log_dir", os.path.join(run_copy, "run", "logs"), "steps=8", "checkpoint.every_steps=2"]
    env = process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ELASTIC_FT_FAULTS="fail_load:rank=1")
    proc = torchrun(2, args, env=env, timeout=240)
    assert proc.returncode != 0, explain(proc)
    output = (proc.stdout + proc.stderr).splitlines()
    # Every rank logs the failure as it stops (torchrun may end rank 0 before its final error line).
    for rank in (0, 1):
        [line] = [ln for ln in output if f"rank {rank}: cannot resume run 'run'" in ln]
        assert "000000000006.json" in line and "rank 1: OSError" in line and "injected checkpoint read failure" in line
    [failed] = [e for e in read_events(os.path.join(run_copy, "run", "logs", "events.jsonl"))
                if e["event"] == "resume_failed"]  # written by rank 0, the leader, which loaded fine
    assert "rank 1: OSError" in failed["reason"] and "rank 0" not in failed["reason"]
    # torchrun prints its own traceback for a failed worker; none comes from the workers' code.
    assert not re.search(r'File ".*/elastic_ft/', proc.stderr), explain(proc)
    assert tree_digest(os.path.join(run_copy, "run", "manifests")) == before and quarantine(run_copy) == []
