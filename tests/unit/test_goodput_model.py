"""The goodput model (bench/goodput_model.py, goodput_sim, goodput_costs, goodput_traces): pure, no process.

It must be driven by the product's own decisions (the functions it calls
are the product's objects, and are called), give the no-failure goodput
computed by hand on a trace without removals, redo exactly the steps since
the last commit on an unannounced loss (none with a notice), reproduce what
bench/preemption.py measured on this machine within 5 points, and be a
pure function of its seed.
"""

from __future__ import annotations

import json

import pytest

import elastic_ft.runevents.goodput as goodput
import elastic_ft.spot.policy as policy
import elastic_ft.train.cadence as cadence
import elastic_ft.train.checkpoint_interval as checkpoint_interval
import elastic_ft.train.resume as resume
import elastic_ft.train.scaling as scaling
from bench import goodput_costs, goodput_model, goodput_sim, goodput_traces
from bench.goodput_traces import NodeEvent

BENCH_GOODPUT = 0.534
"""bench/preemption.py on main (issue 26): 53.4 % at one preemption per 67 s (notice, kill, silent)."""


def _costs(**changes) -> goodput_costs.Costs:
    """A table with round numbers: 4 ranks x 8 samples of a 32-sample batch = one 1 s micro-batch a step."""
    base = dict(micro_step_s=1.0, step_sync_s=0.0, ckpt_block_s=0.0, ckpt_upload_s=0.0, commit_sync_s=0.0,
                initial_restart_s=0.0, initial_load_s=0.0, join_boot_s=0.0, every_steps=10, global_batch=32, micro_batch=8, gpus_per_node=1)
    return goodput_costs.CPU.replace(**{**base, **changes})


def _nodes(n: int) -> list[NodeEvent]:
    return [NodeEvent(0.0, "add", f"n{i}") for i in range(n)]


def test_the_model_calls_the_products_own_functions(monkeypatch):
    assert goodput_sim.decide is policy.decide
    assert goodput_sim.leaving_nodes is policy.leaving_nodes
    assert goodput_sim.checkpoint_due is cadence.checkpoint_due
    assert goodput_sim.plan_batch is scaling.plan_batch
    assert goodput_sim.plan_resume is resume.plan_resume
    assert goodput_sim.CATEGORIES is goodput.CATEGORIES
    assert goodput_model.CATEGORIES is goodput.CATEGORIES and goodput_model.LABELS is goodput.LABELS
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)
        monkeypatch.setattr(goodput_sim, name, wrapper)

    for name in ("decide", "leaving_nodes", "checkpoint_due", "plan_batch", "plan_resume"):
        counted(name, getattr(goodput_sim, name))
    trace = _nodes(4) + [NodeEvent(30.5, "remove", "n1"), NodeEvent(90.0, "remove", "n2", notice_s=20.0)]
    goodput_sim.simulate(trace, _costs(), end=100.0)
    assert set(calls) == {"decide", "leaving_nodes", "checkpoint_due", "plan_batch", "plan_resume"}


@pytest.mark.parametrize("every,block,start", [(10, 0.5, 0.0), (7, 2.0, 5.0), (1, 0.25, 3.0)])
def test_no_removal_gives_the_no_failure_goodput(every, block, start):
    costs = _costs(every_steps=every, ckpt_block_s=block, initial_restart_s=start, micro_step_s=0.3)
    step = 0.3 * 1  # 32 samples over 4 ranks = 8 each = one micro-batch of 8
    cycles = 40
    end = start + cycles * (every * step + block)
    r = goodput_sim.simulate(_nodes(4), costs, end=end)
    expected = cycles * every * step / end
    assert r.goodput == pytest.approx(expected, rel=1e-9)
    assert r.seconds["checkpoint"] == pytest.approx(cycles * block)
    assert r.seconds["redone"] == 0 and r.seconds["restart"] == pytest.approx(start)
    assert sum(r.seconds.values()) == pytest.approx(r.wall)
    assert r.kept_steps == cycles * every


def test_the_first_start_is_restart_to_the_workers_start_then_loading_as_elastic_ft_goodput_counts_it():
    # goodput's _walk: agent start -> the worker's start is restart, the worker's start -> its resume plan loading
    r = goodput_sim.simulate(_nodes(4), _costs(initial_restart_s=4.0, initial_load_s=6.0), end=30.0)
    assert r.seconds["restart"] == pytest.approx(4.0) and r.seconds["loading"] == pytest.approx(6.0)
    assert r.seconds["kept"] == pytest.approx(20.0)
    assert next(x for x in r.recoveries if x["kind"] == "start")["seconds"] == pytest.approx(10.0)


def test_an_arriving_node_boots_while_the_others_train_then_joins():
    # 3 ranks: 11 samples on the slowest = 2 micro-batches = 2 s steps. n3 starts at 10 s; its agent joins at 15 s,
    # so the world trains on to the boundary at 16 s (step 8), then restarts with it.
    costs = _costs(join_boot_s=5.0)
    r = goodput_sim.simulate(_nodes(3) + [NodeEvent(10.0, "add", "n3")], costs, end=40.0)
    join = next(x for x in r.recoveries if x["kind"] == "join")
    assert join["t"] == pytest.approx(16.0) and join["world"] == 4
    assert r.seconds["restart"] == pytest.approx(costs.join_rendezvous_s)
    # a node gone before its agent joined never enters a round: nothing to commit, restart or redo
    r = goodput_sim.simulate(_nodes(3) + [NodeEvent(10.0, "add", "n3"), NodeEvent(13.0, "remove", "n3")],
                             costs, end=40.0)
    assert [x["kind"] for x in r.recoveries] == ["start"] and r.goodput == pytest.approx(1.0)


def test_an_unannounced_loss_redoes_the_steps_since_the_last_commit():
    # 1 s steps, a commit every 10: steps 21-25 are done when n1 goes at 25.5 s; the half step is lost too.
    r = goodput_sim.simulate(_nodes(4) + [NodeEvent(25.5, "remove", "n1")], _costs(), end=60.0)
    rollback = next(x for x in r.recoveries if x["kind"] == "rollback")
    assert rollback["redone_steps"] == 5 and rollback["resume_step"] == 20
    assert rollback["reason"].startswith("resuming from step 20")  # plan_resume's own words
    assert r.seconds["redone"] == pytest.approx(5.0)
    c = _costs()
    assert r.seconds["restart"] == pytest.approx(0.5 + c.detect_s + c.rendezvous_s)
    assert r.seconds["loading"] == pytest.approx(c.worker_start_s + c.load_s)


def test_a_removal_with_a_notice_commits_and_redoes_nothing():
    trace = _nodes(4) + [NodeEvent(40.5, "remove", "n1", notice_s=15.0)]
    r = goodput_sim.simulate(trace, _costs(commit_sync_s=0.5), end=80.0)
    assert r.seconds["redone"] == 0
    leave = next(x for x in r.recoveries if x["kind"] == "leave")
    assert leave["reason"].startswith("terminate: commit")  # decide's own words
    assert leave["t"] == pytest.approx(27.5)  # notice at 25.5, seen a poll later, the step ending at 27 committed
    assert not any(x["kind"] == "rollback" for x in r.recoveries)


def test_a_notice_too_short_for_the_commit_is_a_loss():
    trace = _nodes(4) + [NodeEvent(42.5, "remove", "n1", notice_s=2.0)]
    r = goodput_sim.simulate(trace, _costs(commit_sync_s=5.0), end=80.0)
    # seen at 41.5, the commit starts at the boundary at 42 and needs 5 s: steps 41 and 42 are lost
    assert [x["redone_steps"] for x in r.recoveries if x["kind"] == "rollback"] == [2]


def bench_trace() -> tuple[list[NodeEvent], float]:
    """bench/preemption.py's default run: 3 ranks; a notice, a kill and a silent node 60 s apart (first at 30 s
    after the first step), each node started again once the others train again (its replacement a second after
    the bench saw their first step); stopped 180 s after the first step."""
    c = goodput_costs.CPU
    s0 = c.initial_restart_s + c.initial_load_s
    back = [9.2, 15.8, 15.4]  # event -> first step of the new world, bench/preemption.py (issue 26)
    trace = _nodes(3)
    for k, (notice, victim) in enumerate([(120.0, "n0"), (0.0, "n1"), (0.0, "n2")]):
        t = s0 + 30.0 + 60.0 * k  # the notice is served then; the node goes a notice later
        trace += [NodeEvent(t + notice, "remove", victim, notice), NodeEvent(t + back[k] + 1.0, "add", f"r{k}")]
    return trace, s0 + 180.0


def test_the_cpu_table_reproduces_the_preemption_bench_within_5_points():
    trace, end = bench_trace()
    r = goodput_sim.simulate(trace, goodput_costs.CPU, end=end)
    assert abs(r.goodput - BENCH_GOODPUT) <= 0.05, r.seconds


def test_same_seed_same_result_and_another_seed_another():
    def once(seed):
        trace = goodput_traces.synthetic(nodes=16, monthly_share=0.9, hours=24, seed=seed, replace_s=120)
        return trace, goodput_sim.simulate(trace, goodput_costs.GPU, max_nodes=16, end=24 * 3600.0)

    (t1, r1), (t2, r2), (t3, _) = once(7), once(7), once(8)
    assert t1 == t2 and r1 == r2 and t1 != t3
    assert any(e.kind == "remove" for e in t1)


def test_cost_file_overrides_and_names_a_bad_field(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"micro_step_s": {"value": 0.4, "source": "measured on p5"}, "every_steps": 25}))
    c = goodput_costs.load("gpu", str(f))
    assert c.micro_step_s == 0.4 and c.sources["micro_step_s"] == "measured on p5" and c.every_steps == 25
    f.write_text(json.dumps({"step_time": 1}))
    with pytest.raises(goodput_costs.CostsError, match="unknown cost field 'step_time'"):
        goodput_costs.load("gpu", str(f))
    f.write_text(json.dumps({"detect_s": -1}))
    with pytest.raises(goodput_costs.CostsError, match="detect_s must be from 0"):
        goodput_costs.load("cpu", str(f))


def test_every_cost_has_a_source():
    for costs in goodput_costs.PROFILES.values():
        fields = {f for f in goodput_costs._FIELDS}
        assert set(costs.sources) == fields, fields ^ set(costs.sources)


def test_cli_json_on_a_trace_file(tmp_path, capsys):
    f = tmp_path / "t.csv"
    f.write_text("0,add,a\n0,add,b\n600000,remove,b\n660000,add,c\n1800000,remove,a\n")
    assert goodput_model.main(["--trace", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["categories"]) == set(goodput.CATEGORIES)
    assert sum(out["categories"].values()) == pytest.approx(out["wall_s"], abs=0.1)
    assert 0 < out["goodput"] < 1 and out["losses"] >= 1
    assert any(r["young_daly"] for r in out["intervals"])


def test_cli_bad_trace_is_one_line(tmp_path, capsys):
    assert goodput_model.main(["--trace", str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--trace: cannot read") and "\n" not in err
    (tmp_path / "bad.csv").write_text("0,add,a\n5,leave,a\n")
    assert goodput_model.main(["--trace", str(tmp_path / "bad.csv")]) == 2
    assert "bad.csv:2" in capsys.readouterr().err


def test_the_interval_compared_is_the_products_auto_choice(tmp_path):
    """The Young/Daly row is what ``checkpoint.every_steps: auto`` would choose: the product's function."""
    assert goodput_model.choose_interval is checkpoint_interval.choose_interval
    trace = [NodeEvent(0.0, "add", "a"), NodeEvent(0.0, "add", "b"),
             NodeEvent(1800.0, "remove", "a"), NodeEvent(1900.0, "add", "c")]
    assert goodput_model.losses(trace, 3600.0) == 1 and goodput_model.losses(trace, 1000.0) == 0
