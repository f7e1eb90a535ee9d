"""Evaluation across a kill and changes of world: the eval loss at step S of a run killed at world 1 and
resumed at world 3 equals that of an uninterrupted run at world 2; and ``checkpoint.keep_best`` keeps the
checkpoint of the lowest eval loss through retention, which ``export --best`` exports.

Short on purpose (the suite's budget): 4 steps of the tiny model, an evaluation every 2 steps on 48
held-out samples of the demo corpus (``data.eval_fraction``).
"""

from __future__ import annotations

import math
import os

import pytest

from elastic_ft import cli
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.reader import list_manifests, read_manifest
from elastic_ft.checkpoint.retention import eval_loss
from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.status import kept_evals
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun
from tests.e2e.conftest import train

STEPS = 4
EVAL = ["data.eval_fraction=0.1", "eval.every_steps=2", "eval.max_samples=48"]
COMMON = [f"steps={STEPS}", "checkpoint.every_steps=1", "checkpoint.keep_last=null", "logging.every_steps=1", *EVAL]
TOLERANCE = 1e-5
"""Absolute, on eval losses of about 5 (measured: 1.3e-7): the worlds' weights differ by the float summation
order of their gradients only (the held-out micro-batches are the same at every world, see
elastic_ft.train.evaluation)."""


def worker_args(root: str, run_id: str, *extra: str) -> list[str]:
    return ["--spec", DEFAULT_SPEC, "--run_id", run_id, "--checkpoint_uri", f"file://{root}",
            "--log_dir", os.path.join(root, run_id, "logs"), *COMMON, *extra]


def evals_of(root: str, run_id: str) -> tuple[list[dict], dict[int, float]]:
    events = read_events(os.path.join(root, run_id, "logs", "events.jsonl"))
    return events, {step: float(e["loss"]) for step, e in kept_evals(events).items()}


@pytest.mark.slow
@pytest.mark.torchrun
def test_eval_loss_at_a_step_is_the_same_after_a_kill_and_other_worlds(run_root):
    reference = torchrun(2, worker_args(run_root, "ref"))
    assert reference.returncode == 0, explain(reference)
    _, ref = evals_of(run_root, "ref")
    assert sorted(ref) == [2, 4]

    args = worker_args(run_root, "elastic")
    # World 1 until a SIGKILL at the start of step 4 (the evaluation of step 2 done, no restarts left) ...
    first = torchrun(1, args, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                              ELASTIC_FT_FAULTS="kill:step=3"))
    assert first.returncode != 0, "the injected kill did not stop the world-1 attempt"
    # ... then world 3 to the end: 32 samples split 11/11/10.
    second = torchrun(3, args)
    assert second.returncode == 0, explain(second)
    events, got = evals_of(run_root, "elastic")
    assert [e["world"] for e in events if e["event"] == "start"] == [1, 3]
    first_evals = [e["step"] for e in events if e["event"] == "eval" and e["attempt"] == 1]
    assert first_evals == [2], "the world-1 attempt did not evaluate step 2 before the kill"
    assert sorted(got) == [2, 4]
    for step in (2, 4):
        assert math.isclose(got[step], ref[step], abs_tol=TOLERANCE), (step, got[step], ref[step])
    # Not equal by accident: the loss moved between the two evaluations.
    assert abs(ref[4] - ref[2]) > 100 * TOLERANCE


@pytest.mark.slow
def test_keep_best_survives_retention_and_export_best_exports_it(run_root, tmp_path, capsys, monkeypatch):
    # Steps 3 and 4 have a NaN loss, so the guard skips their updates: the weights of steps 3 and 4 are those
    # of step 2, their eval losses equal its, and the earliest of equal losses is the best. So the best is
    # step 1 or 2, never the newest checkpoint, which keep_last=1 alone would keep.
    monkeypatch.setenv("ELASTIC_FT_FAULTS", "nan_loss:step=2;nan_loss:step=3")
    assert train(run_root, "best", "steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
                 "checkpoint.keep_best=true", "data.eval_fraction=0.1", "eval.every_steps=1",
                 "eval.max_samples=16") == 0
    _, finite = evals_of(run_root, "best")
    assert sorted(finite) == [1, 2, 3, 4] and finite[2] == finite[3] == finite[4], finite
    best = min(finite, key=lambda s: (finite[s], s))
    assert best in (1, 2)

    store = LocalStore(os.path.join(run_root, "best"))
    manifests = {read_manifest(store, i.key).step: read_manifest(store, i.key) for i in list_manifests(store)}
    assert sorted(manifests) == sorted({best, 4}), "retention did not keep exactly the newest and the best"
    assert eval_loss(manifests[best]) == pytest.approx(finite[best])

    out = str(tmp_path / "exported")
    assert cli.main(["export", f"file://{os.path.join(run_root, 'best')}", "--out", out, "--best"]) == 0
    assert f"exported step {best} (the lowest eval loss)" in capsys.readouterr().out
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))


@pytest.mark.slow
def test_export_best_without_any_eval_loss_is_one_line(committed_run, tmp_path, capsys):
    out = str(tmp_path / "exported")
    assert cli.main(["export", f"file://{os.path.join(committed_run, 'run')}", "--out", out, "--best"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("elastic-ft: error: export --best: ") and "eval loss" in err, err
    assert not os.path.exists(out)
