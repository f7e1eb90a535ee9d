"""Non-finite training state and failing saves, end to end: the real trainer on the
tiny model, faults injected by step (ELASTIC_FT_FAULTS), checkpoints read back
from disk with the reader. No checkpoint may ever hold a NaN."""

from __future__ import annotations

import os

import pytest
import torch

from elastic_ft.checkpoint.reader import list_manifests, load_blobs, read_manifest
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun
from tests.e2e.conftest import train


def events_of(root: str, run_id: str) -> list[dict]:
    return read_events(os.path.join(root, run_id, "logs", "events.jsonl"))


def committed(root: str, run_id: str) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Every committed checkpoint's tensors by step, each checked to hold finite values only."""
    store = LocalStore(os.path.join(root, run_id))
    out = {}
    for info in list_manifests(store):
        loaded = load_blobs(store, read_manifest(store, info.key, run_id=run_id))
        for group, named in loaded.tensors.items():
            for name, t in named.items():
                assert torch.isfinite(t).all(), f"step {loaded.manifest.step}: {group}/{name} holds NaN/inf"
        out[loaded.manifest.step] = loaded.tensors
    return out


def test_a_nan_loss_skips_its_update_and_the_run_finishes(run_root, monkeypatch):
    monkeypatch.setenv("ELASTIC_FT_FAULTS", "nan_loss:step=2")  # the third step
    assert train(run_root, "r", "steps=5", "checkpoint.every_steps=1", "checkpoint.keep_last=null") == 0
    events = events_of(run_root, "r")
    skipped = [e for e in events if e["event"] == "step_skipped"]
    assert [(e["step"], e["loss"], e["grad_norm"], e["in_row"]) for e in skipped] == [(3, "nan", "nan", 1)]
    assert "gradient norm nan" in skipped[0]["reason"]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 4, 5] and all(0 < e["loss"] < 10 for e in steps)
    assert events[-1]["event"] == "end" and events[-1]["step"] == 5
    ckpts = committed(run_root, "r")
    assert sorted(ckpts) == [1, 2, 3, 4, 5]
    for group in ("model", "optimizer"):  # the skipped step changed nothing: no update, no optimizer step
        assert ckpts[3][group].keys() == ckpts[2][group].keys()
        assert all(torch.equal(ckpts[3][group][k], ckpts[2][group][k]) for k in ckpts[2][group])
    assert not all(torch.equal(ckpts[4]["model"][k], ckpts[3]["model"][k]) for k in ckpts[3]["model"])


def test_nan_losses_in_a_row_stop_the_run(run_root, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_FT_FAULTS", "nan_loss:step=2;nan_loss:step=3")
    code = train(run_root, "r", "steps=10", "checkpoint.every_steps=2", "optimizer.max_nonfinite_steps=2")
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("elastic_ft: error: training stopped at step 4: 2 step(s) in a row had a non-finite loss or gradient "
            "(optimizer.max_nonfinite_steps=2); the last: gradient norm nan, loss nan") in err
    events = events_of(run_root, "r")
    assert [e["step"] for e in events if e["event"] == "step_skipped"] == [3, 4]
    # The save of step 2 is asynchronous: on a busy machine its commit may be
    # logged after the abort (the run waits for it on the way out), never a later step's.
    [aborted] = [i for i, e in enumerate(events) if e["event"] == "aborted"]
    assert events[aborted]["step"] == 4
    assert all(e["event"] == "checkpoint_committed" and e["step"] == 2 for e in events[aborted + 1:]), events
    assert sorted(committed(run_root, "r")) == [2]


@pytest.mark.slow  # trains in this process: over 10 s on 2 cores
def test_nan_weights_are_never_checkpointed(run_root, monkeypatch, capsys):
    # The guard's limit is high, so it is the refused checkpoint that stops the run.
    monkeypatch.setenv("ELASTIC_FT_FAULTS", "nan_weight:step=3")
    code = train(run_root, "r", "steps=10", "checkpoint.every_steps=2", "optimizer.max_nonfinite_steps=100")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "elastic_ft: error: run 'r' stopped at step 6: checkpoint of step 4 refused" in err
    assert "non-finite values (NaN or inf) in model/" in err
    events = events_of(run_root, "r")
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"] == [4]
    assert [e["step"] for e in events if e["event"] == "step_skipped"] == [4, 5, 6]
    assert sorted(committed(run_root, "r")) == [2]
    assert not [o for o in LocalStore(os.path.join(run_root, "r")).list("blobs/000000000004-")]


@pytest.mark.slow  # trains in this process: over 10 s on 2 cores
def test_saves_failing_in_a_row_stop_the_run(run_root, capsys):
    # A real filesystem fault: a file where the blob directory must go fails every blob write.
    os.makedirs(os.path.join(run_root, "r"))
    open(os.path.join(run_root, "r", "blobs"), "w").close()
    code = train(run_root, "r", "steps=6", "checkpoint.every_steps=1", "checkpoint.max_failed_saves=2")
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("elastic_ft: error: run 'r' stopped at step 3: 2 checkpoint saves in a row failed (limit 2, "
            "checkpoint.max_failed_saves); the last: checkpoint of step 2 not committed") in err
    assert "blobs/000000000002-" in err, "the error does not name the cause"
    events = events_of(run_root, "r")
    failed = [(e["step"], e["in_row"], e["limit"]) for e in events if e["event"] == "checkpoint_failed"]
    assert failed == [(1, 1, 2), (2, 2, 2)]
    assert events[-1]["event"] == "aborted" and "end" not in {e["event"] for e in events}
    assert list_manifests(LocalStore(os.path.join(run_root, "r"))) == []


@pytest.mark.torchrun
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(run_root):
    # Only rank 1's loss is NaN; the gradient norm after DDP's all-reduce is NaN on
    # both ranks, so both skip the update (a rank that stepped alone would leave
    # the other waiting in a collective, and the replicas would differ).
    args = ["--spec", DEFAULT_SPEC, "--run_id", "r", "--checkpoint_uri", f"file://{run_root}",
            "--log_dir", os.path.join(run_root, "r", "logs"), "steps=4", "checkpoint.every_steps=2"]
    env = process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ELASTIC_FT_FAULTS="nan_loss:rank=1,step=1")
    proc = torchrun(2, args, env=env, timeout=300)
    assert proc.returncode == 0, explain(proc)
    events = events_of(run_root, "r")
    skipped = [e for e in events if e["event"] == "step_skipped"]
    assert [(e["step"], e["loss"]) for e in skipped] == [(2, "nan")]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 3, 4]
    assert events[-1]["event"] == "end" and events[-1]["step"] == 4
    assert sorted(committed(run_root, "r")) == [2, 4]
