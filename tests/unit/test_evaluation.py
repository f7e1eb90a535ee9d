"""Evaluation in this process: the eval_fraction split (deterministic, by sample, independent of the world),
which micro-batches each rank evaluates, the token-weighted loss, abandoning on a notice, the config errors,
and the manifest's record of an evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from elastic_ft.checkpoint.manifest import BlobRef, Manifest, ManifestCorrupt, manifest_key, parse_manifest
from elastic_ft.checkpoint.retention import eval_loss
from elastic_ft.config import ConfigError, load_spec
from elastic_ft.runevents.events import EventLog, read_events
from elastic_ft.spot.watcher import Notice, NoticeBoard
from elastic_ft.train import data as data_mod
from elastic_ft.train import heldout, loss as loss_mod, model as model_mod
from elastic_ft.train.cursor import take
from elastic_ft.train.datafiles import DataError
from elastic_ft.train.evaluation import Evaluator, due, eval_chunks, rank_chunks
from elastic_ft.train.preemption import NoticePoll
from elastic_ft.train.world import World
from tests.conftest import DEFAULT_SPEC


# ------------------------------------------------------------------ the split


def test_eval_fraction_split_is_deterministic_and_by_sample():
    a = heldout.held_out(10_000, 0.1, seed=1234)
    assert np.array_equal(a, heldout.held_out(10_000, 0.1, seed=1234))  # the same every start
    assert 0.08 < a.mean() < 0.12
    # By sample: a sample's side does not depend on how many samples there are (or who reads them).
    assert np.array_equal(heldout.held_out(2_500, 0.1, seed=1234), a[:2_500])
    # A larger fraction holds out a superset: the hash per sample is compared with the fraction.
    assert not (a & ~heldout.held_out(10_000, 0.3, seed=1234)).any()
    # Another seed, another split.
    assert not np.array_equal(a, heldout.held_out(10_000, 0.1, seed=1235))


def test_the_held_out_samples_and_their_micro_batches_do_not_depend_on_the_world_size():
    """Every world evaluates the same micro-batches (the same samples, so the same padding and sums): the deal
    to ranks partitions them, whatever the world's size."""
    held = np.flatnonzero(heldout.held_out(1024, 0.2, seed=7))
    first = held[:100]
    chunks = eval_chunks(len(first), 8)
    assert [p for c in chunks for p in c] == list(range(100)) and all(len(c) <= 8 for c in chunks)
    for world in (1, 2, 3, 5, 16):
        dealt = [c for r in range(world) for c in rank_chunks(len(chunks), r, world)]
        assert sorted(dealt) == list(range(len(chunks))), world  # each micro-batch once, at any world


def test_the_training_order_runs_over_the_training_samples_only(cache):
    store = data_mod.load(load_spec(DEFAULT_SPEC).data, model_mod.byte_tokenizer())
    train, held = heldout.split(store, 0.1, seed=1234)
    assert len(train) + len(held) == len(store) == 1024
    assert set(train.index.tolist()).isdisjoint(held.index.tolist())
    # An epoch of the cursor over the view: every training sample once, no held-out one.
    epoch = [i for _, i in take(0, len(train), len(train), 1234)]
    assert sorted(train.index[epoch].tolist()) == train.index.tolist()
    # The view hands out the store's samples under the mapped numbers.
    batch, direct = train.batch([0, 5]), store.batch([int(train.index[0]), int(train.index[5])])
    assert all(torch.equal(batch[k], direct[k]) for k in batch)
    assert train.target_count([0, 5]) == store.target_count([int(train.index[0]), int(train.index[5])])


def test_with_packing_whole_packed_rows_are_held_out_and_the_views_give_the_stores_rows(cache):
    """The split is over the store's items: with ``data.packing`` its packed rows; the views hand the step loop
    and the evaluation the rows they map to, laid out as the store lays them (position ids per sample)."""
    import dataclasses

    cfg = dataclasses.replace(load_spec(DEFAULT_SPEC).data, packing=True)
    store = data_mod.load(cfg, model_mod.byte_tokenizer())
    assert store.packed
    train, held = heldout.split(store, 0.2, seed=1234)
    assert train.packed and held.packed and len(train) + len(held) == len(store)
    picked = [0, len(held) - 1]
    ours, theirs = held.batch(picked), store.batch(held.index[picked].tolist())
    assert ours.keys() == theirs.keys() and "position_ids" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    rows = held.index[picked].tolist()
    assert held.computed_tokens([picked], flat=True) == store.computed_tokens([rows], flat=True)


def test_a_fraction_that_empties_a_side_is_one_line_naming_the_field(cache):
    store = data_mod.load(load_spec(DEFAULT_SPEC).data, model_mod.byte_tokenizer())
    with pytest.raises(DataError, match=r"^data\.eval_fraction: 1e-09 holds out no sample of the 1024 samples"):
        heldout.split(store, 1e-9, seed=1234)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "node-cache"))
    return tmp_path / "node-cache"


# ------------------------------------------------------------------ when


def test_due_every_n_steps_and_at_the_last():
    assert [s for s in range(0, 11) if due(s, 10, 4)] == [4, 8, 10]
    assert not any(due(s, 10, None) for s in range(11))


# ------------------------------------------------------------------ the loss, and a notice


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo spec's model and the held-out side of a 0.2 split of its corpus (built once: seconds)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path_factory.mktemp("node-cache")))
        spec = load_spec(DEFAULT_SPEC)
        tok, model = model_mod.build(spec)
        _, held = heldout.split(data_mod.load(spec.data, tok), 0.2, seed=spec.seed)
    return model, held


@pytest.fixture
def evaluator(tmp_path, demo):
    return lambda samples=40: make_evaluator(tmp_path, demo, samples)


def make_evaluator(tmp_path, demo, samples: int):
    model, held = demo
    events = EventLog(str(tmp_path / "events.jsonl"))
    world = World(0, 1, 0, 1, torch.device("cpu"))
    ev = Evaluator(held, every_steps=2, max_samples=samples, micro_batch=8, world=world, events=events,
                   chunk_tokens=None, autocast=lambda: torch.autocast("cpu", enabled=False))
    return ev, model, held, events


def test_the_eval_loss_is_token_weighted_over_the_first_samples_in_store_order(evaluator):
    ev, model, held, events = evaluator()
    model.train()
    result = ev.run(2, model=model, forward=model, sharded=False, poll=NoticePoll(ev.world, NoticeBoard()))
    assert model.training, "the model was left in eval mode"
    # By hand: per sample, in eval mode, summed losses over summed target tokens.
    model.eval()
    with torch.no_grad():
        sums = [float(loss_mod.summed_loss(model, model, held.batch([i]), chunk_tokens=None,
                                           autocast=lambda: torch.autocast("cpu", enabled=False))) for i in range(40)]
    tokens = held.target_count(list(range(40)))
    assert result.tokens == tokens and result.samples == 40
    assert result.loss == pytest.approx(sum(sums) / tokens, rel=1e-5)
    (event,) = [e for e in read_events(events.path) if e["event"] == "eval"]
    assert (event["step"], event["tokens"]) == (2, tokens) and event["loss"] == pytest.approx(result.loss)
    assert ev.record_for(2) == {"step": 2, "loss": result.loss, "tokens": tokens, "samples": 40}
    assert ev.record_for(4) == {} and not ev.due(2, 10) and ev.due(4, 10)


def test_a_notice_abandons_the_evaluation_between_micro_batches(evaluator):
    ev, model, _, events = evaluator(200)  # 25 micro-batches
    board = NoticeBoard()
    calls = []

    class Poll(NoticePoll):
        def standing(self):
            calls.append(1)
            if len(calls) == 3:  # a leave notice arrives during the fourth micro-batch
                board.post(Notice("terminate", None, 0.0, "test"))
            return super().standing()

    model.train()
    assert ev.run(2, model=model, forward=model, sharded=False, poll=Poll(ev.world, board)) is None
    assert model.training
    (abandoned,) = [e for e in read_events(events.path) if e["event"] == "eval_abandoned"]
    assert abandoned["per_rank_done"] == 3 < abandoned["per_rank"] == 25
    assert not [e for e in read_events(events.path) if e["event"] == "eval"]
    assert ev.due(2, 10), "an abandoned evaluation must be redone"
    assert ev.record_for(2) == {}


def test_a_rebalance_recommendation_does_not_stop_an_evaluation(evaluator):
    ev, model, _, _ = evaluator(24)
    board = NoticeBoard()
    board.post(Notice("rebalance", None, 0.0, "test"))
    assert ev.run(2, model=model, forward=model, sharded=False, poll=NoticePoll(ev.world, board)) is not None


def test_a_resume_at_a_step_evaluated_before_the_save_does_not_evaluate_again(evaluator):
    ev, *_ = evaluator()
    ev.resumed({}, 4)
    assert ev.due(4, 10)  # the manifest says nothing: the evaluation did not finish
    ev.resumed({"step": 2, "loss": 1.0}, 4)
    assert ev.due(4, 10)  # an older step's record is not this step's
    ev.resumed({"step": 4, "loss": 1.0}, 4)
    assert not ev.due(4, 10)


# ------------------------------------------------------------------ the manifest


def test_the_manifest_records_the_evaluation_for_retention():
    m = Manifest(run_id="r", step=20, cursor=640, created=1.0, writer="w", config_hash="c",
                 blobs={"model": BlobRef("blobs/x/model.safetensors", 1, "f" * 64)},
                 eval={"step": 20, "loss": 1.25, "tokens": 99, "samples": 8})
    back = parse_manifest(m.to_json(), key=manifest_key(20))
    assert back == m and eval_loss(back) == 1.25
    d = json.loads(m.to_json())
    d.pop("eval")  # a manifest written before evaluation existed
    assert eval_loss(parse_manifest(json.dumps(d).encode(), key=manifest_key(20))) is None
    d["eval"] = {"step": 10, "loss": 0.5}  # another step's evaluation is not this checkpoint's
    assert eval_loss(parse_manifest(json.dumps(d).encode(), key=manifest_key(20))) is None
    d["eval"] = [1]
    with pytest.raises(ManifestCorrupt, match="eval must be an object"):
        parse_manifest(json.dumps(d).encode(), key=manifest_key(20))


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides, field, text", [
    (["data.eval_fraction=0.1", "data.eval_files=[x.jsonl]", "eval.every_steps=5"], "data.eval_fraction",
     "cannot be combined with data.eval_files"),
    (["eval.every_steps=5"], "eval.every_steps", "needs held-out data"),
    (["data.eval_fraction=0.1"], "eval.every_steps", "must be set"),
    (["data.eval_fraction=1.0", "eval.every_steps=5"], "data.eval_fraction", "must be in (0.0, 1.0)"),
    (["data.eval_fraction=0.1", "eval.every_steps=5", "eval.max_samples=0"], "eval.max_samples", "must be in [1,"),
    (["checkpoint.keep_best=true"], "checkpoint.keep_best", "needs evaluation"),
    (["checkpoint.keep_best=true", "data.eval_fraction=0.1", "eval.every_steps=3", "checkpoint.every_steps=10"],
     "checkpoint.keep_best", "must be a multiple of eval.every_steps (3)"),
    (["data.eval_files=[/nonexistent/eval.jsonl]", "eval.every_steps=5"], "data.eval_files[0]", "does not exist"),
])
def test_eval_settings_errors_name_the_field(overrides, field, text):
    with pytest.raises(ConfigError) as info:
        load_spec(DEFAULT_SPEC, overrides)
    problems = dict(info.value.problems)
    assert field in problems and text in problems[field], problems


def test_eval_files_and_settings_do_not_change_the_config_hash_but_a_fraction_does():
    base = load_spec(DEFAULT_SPEC).hash()
    assert load_spec(DEFAULT_SPEC, [f"data.eval_files=[{DEFAULT_SPEC}]", "eval.every_steps=5",
                                    "eval.max_samples=9"]).hash() == base
    assert load_spec(DEFAULT_SPEC, ["data.eval_fraction=0.1", "eval.every_steps=5"]).hash() != base


# ------------------------------------------------------------------ a notice the policy trains on


def _trainer(tmp_path, attempt: str):
    """The real trainer in this process (one rank, no process group) on a short run with an evaluation every
    2 steps and ``spot.train_until_deadline``: a leave notice with time left is trained on."""
    import os

    from elastic_ft.train import loop
    from tests.unit.inprocess import SHORT

    spec = load_spec(DEFAULT_SPEC, [*SHORT, "checkpoint.every_steps=2", "data.eval_fraction=0.2",
                                    "eval.every_steps=2", "eval.max_samples=40", "spot.enabled=false",
                                    "spot.train_until_deadline=true"])
    opts = loop.RunOptions(run_id="standing", checkpoint_uri=f"file://{tmp_path}/ckpt",
                           log_dir=os.path.join(tmp_path, attempt))
    return loop.Trainer(spec, opts, World(0, 1, 0, 1, torch.device("cpu"))), os.path.join(tmp_path, attempt,
                                                                                          "events.jsonl")


@pytest.mark.parametrize("notice_after, started_after, leaves_at", [(3, 0, 4), (6, 1, 6)],
                         ids=["mid-run", "after-the-last-step"])
def test_under_a_standing_notice_no_evaluation_is_started_again_and_the_resume_redoes_it(
        cache, tmp_path, notice_after, started_after, leaves_at):
    """A terminate notice an hour ahead, posted after step ``notice_after``; the policy trains on. An
    evaluation due under it would be abandoned at every try (the old loop retried it at every boundary, and
    after the last step spun until the deadline; mid-run the step's evaluation was lost): none is started once
    the ranks agreed on the notice (one already running when it came is abandoned), the run commits the
    evaluated step and leaves, and the resume evaluates that step before anything else."""
    import time

    from elastic_ft.train.preemption import Preempted

    threads = torch.get_num_threads()
    trainer, events_path = _trainer(tmp_path, "first")
    posted = []
    started_under_notice = []
    step_once, run_eval = trainer.step_once, trainer.evaluator.run

    def step_then_notice():
        result = step_once()
        if trainer.step == notice_after:
            trainer.saver.flush()  # a commit measured: the policy weighs it against the time left
            trainer.preemption.board.post(Notice("terminate", time.time() + 3600, time.time(), "test"))
            posted.append(trainer.step)
        return result

    def counted_run(step, **kw):
        if posted:
            started_under_notice.append(step)
            assert len(started_under_notice) <= started_after, f"evaluations started under the notice: " \
                                                               f"{started_under_notice}"
        return run_eval(step, **kw)

    trainer.step_once, trainer.evaluator.run = step_then_notice, counted_run
    try:
        with pytest.raises(Preempted) as info:
            trainer.run()
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    assert info.value.step == leaves_at and len(started_under_notice) == started_after
    events = read_events(events_path)
    decisions = [(e["step"], e["action"]) for e in events if e["event"] == "spot_decision"]
    assert decisions[0] == (notice_after, "none"), decisions  # trained on: the case at hand
    (left,) = [e for e in events if e["event"] == "spot_decision" and e["action"] != "none"]
    assert left["step"] == leaves_at and f"the evaluation of step {leaves_at} cannot finish" in left["reason"]
    assert [e["step"] for e in events if e["event"] == "eval"] == [2] + ([4] if notice_after > 4 else [])

    resumed, events_path = _trainer(tmp_path, "second")
    try:
        assert resumed.run()["step"] == 6
    finally:
        resumed.close()
        torch.set_num_threads(threads)
    events = read_events(events_path)
    assert [e["step"] for e in events if e["event"] == "eval"] == sorted({leaves_at, 6})
    order = [(e["event"], e["step"]) for e in events if e["event"] in ("eval", "step_done")]
    # the resumed step's evaluation first, then the steps left
    assert order[0] == ("eval", leaves_at) and len(order) == len({leaves_at, 6}) + 6 - leaves_at, order
    if leaves_at < 6:  # the redone evaluation is in the next checkpoint's manifest, by the step it evaluated
        from elastic_ft.checkpoint.reader import read_manifest
        from elastic_ft.checkpoint.retention import eval_losses
        from elastic_ft.checkpoint.store import open_store

        store = open_store(f"file://{tmp_path}/ckpt/standing")
        try:
            losses = eval_losses([read_manifest(store, manifest_key(6))])
        finally:
            store.close()
        redone = next(e for e in events if e["event"] == "eval" and e["step"] == leaves_at)
        assert set(losses) == {leaves_at, 6} and losses[leaves_at] == pytest.approx(redone["loss"])


def test_an_evaluation_redone_after_the_resume_is_carried_by_every_later_checkpoint(evaluator):
    """The resumed checkpoint (step 4) holds no evaluation of 4 (a notice abandoned it): the evaluation redone
    after the resume goes into every later manifest as a late record, with those the resumed one carried."""
    from elastic_ft.checkpoint.retention import eval_losses

    ev, model, _, _ = evaluator(16)
    ev.resumed({"step": 2, "loss": 3.0, "late": [{"step": 2, "loss": 3.0}, {"bad": 1}]}, 4)
    assert ev.due(4, 10)
    result = ev.run(4, model=model, forward=model, sharded=False, poll=NoticePoll(ev.world, NoticeBoard()))
    assert ev.record_for(4)["step"] == 4  # its own, as before
    carried = ev.record_for(6)
    assert "step" not in carried
    by_step = sorted(carried["late"], key=lambda r: r["step"])
    assert by_step == [{"step": 2, "loss": 3.0}, {"step": 4, "loss": result.loss}]
    ev.run(6, model=model, forward=model, sharded=False, poll=NoticePoll(ev.world, NoticeBoard()))
    m = Manifest(run_id="r", step=6, cursor=48, created=1.0, writer="w", config_hash="c",
                 blobs={"model": BlobRef("blobs/x/model.safetensors", 1, "f" * 64)}, eval=ev.record_for(6))
    assert set(eval_losses([parse_manifest(m.to_json(), key=manifest_key(6))])) == {2, 4, 6}
    # A step evaluated before its save leaves no late record.
    fresh, *_ = evaluator(16)
    fresh.resumed({"step": 4, "loss": 1.0}, 4)
    fresh.run(6, model=model, forward=model, sharded=False, poll=NoticePoll(fresh.world, NoticeBoard()))
    assert "late" not in fresh.record_for(6)
