"""Step metrics (elastic_ft.train.metrics) on a single process: what is reported, and when."""

import pytest
import torch

import math

from elastic_ft.runevents.events import EventLog, next_attempt, read_events
from elastic_ft.train.metrics import Metrics, StepResult, eta_seconds, fmt_eta, number
from elastic_ft.train.world import World


def _metrics(tmp_path, *, total_steps=5, every_steps=2):
    world = World(rank=0, size=1, local_rank=0, local_size=1, device=torch.device("cpu"))
    events = EventLog(str(tmp_path / "events.jsonl"), run_id="r")
    return Metrics(world, events, total_steps=total_steps, every_steps=every_steps), events


def _step(step, loss_sum, tokens, skipped=None, t_end=float("nan")):
    return StepResult(step, 1e-3, tokens, None, torch.tensor(loss_sum, dtype=torch.float64), seconds=0.5,
                      skipped=skipped, t_end=t_end)


def test_steps_are_reported_every_n_steps_and_at_the_last(tmp_path):
    m, events = _metrics(tmp_path)
    expected = {1: [], 2: [1, 2], 3: [1, 2], 4: [1, 2, 3, 4], 5: [1, 2, 3, 4, 5]}  # every 2, and step 5 of 5
    for s in range(1, 6):
        m.add(_step(s, 2.0 * s, 4))
        reported = [e["step"] for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "step"]
        assert reported == expected[s]
    events.close()
    assert m.last_loss == 2.5  # 10 summed over 4 tokens: weighted by tokens, not a mean of means


def test_a_skipped_step_is_not_a_loss(tmp_path):
    m, events = _metrics(tmp_path)
    m.add(_step(1, 8.0, 4))
    m.add(_step(2, float("nan"), 4, skipped="non-finite gradient norm"))
    events.close()
    assert [e["step"] for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "step"] == [1]
    assert m.last_loss == 2.0


def test_eta_and_numbers_for_json():
    assert fmt_eta(3725.5) == "1:02:05"
    assert fmt_eta(float("inf")) == fmt_eta(float("nan")) == "?"
    assert number(1.5) == 1.5 and number(float("nan")) == "nan" and number(float("-inf")) == "-inf"


def test_step_events_carry_the_time_each_step_ended_not_the_flush_time(tmp_path):
    m, events = _metrics(tmp_path, total_steps=4, every_steps=4)
    for s in range(1, 5):
        m.add(_step(s, 1.0, 4, t_end=1000.0 + s))
    events.close()
    steps = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "step"]
    assert [e["t_end"] for e in steps] == [1001.0, 1002.0, 1003.0, 1004.0]  # all four written at one flush


def test_eta_counts_neither_start_up_nor_the_slow_first_step():
    # A 13 s run: the first step took 10 s (warm-up), the other 99 take 0.03 s each.
    ends = [10.0 + 0.03 * i for i in range(100)]  # ends[i]: end of step i + 1
    assert math.isnan(eta_seconds(1, ends[0], 1, ends[0], 100))  # one step: no rate yet, not 244 s
    assert eta_seconds(1, ends[0], 2, ends[1], 100) == pytest.approx(0.03 * 98)
    assert eta_seconds(1, ends[0], 50, ends[49], 100) == pytest.approx(0.03 * 50)
    assert eta_seconds(1, ends[0], 100, ends[99], 100) == 0.0
    # After a restart at step 40 the origin is the new attempt's first step, not the run's.
    assert eta_seconds(41, 500.0, 45, 500.4, 100) == pytest.approx(0.1 * 55)


def test_metrics_estimate_from_the_steps_since_the_restart(tmp_path):
    m, events = _metrics(tmp_path, total_steps=10, every_steps=1)
    m.start()
    m.add(_step(1, 1.0, 4, t_end=100.0))  # loading and a slow first step before it: ignored
    m.add(_step(2, 1.0, 4, t_end=100.5))
    m.start()  # a restart resuming from step 2 after a long outage
    m.add(_step(3, 1.0, 4, t_end=900.0))
    m.add(_step(4, 1.0, 4, t_end=901.0))
    events.close()
    eta = {e["step"]: e["eta_s"] for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "step"}
    assert eta == {1: None, 2: 4.0, 3: None, 4: 6.0}  # None: unknown (JSON has no NaN)


def test_attempts_are_numbered_by_the_starts_already_in_the_file(tmp_path):
    path = str(tmp_path / "events.jsonl")
    assert next_attempt(path) == 1
    for attempt in (1, 2):
        events = EventLog(path, run_id="r", attempt=next_attempt(path))
        events.emit("start", world=2)
        events.emit("step", step=3)
        events.close()
    with open(path, "a") as f:
        f.write('{"ts": 1, "event": "sta')  # a torn last line is no start
    assert next_attempt(path) == 3
    assert [(e["event"], e["attempt"]) for e in read_events(path)] == [
        ("start", 1), ("step", 1), ("start", 2), ("step", 2)]


def test_while_steps_are_kept_each_step_is_reported_at_its_end_and_recorded_for_the_kept_step(tmp_path, monkeypatch):
    import elastic_ft.train.metrics as metrics_mod

    world = World(rank=0, size=1, local_rank=0, local_size=1, device=torch.device("cpu"))
    events = EventLog(str(tmp_path / "events.jsonl"), run_id="r")
    m = Metrics(world, events, total_steps=50, every_steps=10, each_step=True)
    for s in range(1, 4):
        r = _step(s, 2.0 * s, 4)
        r.consumed = [[[0, s]]]
        m.add(r)
        logged = read_events(str(tmp_path / "events.jsonl"))
        # Reported at once, not at step 10: a resume from this kept step finds every step before it.
        assert [e["step"] for e in logged if e["event"] == "step"] == list(range(1, s + 1))
        assert [e["step"] for e in logged if e["event"] == "ledger"] == list(range(s))
    assert [(name, f["step"]) for name, f in m.records] == [("ledger", 0), ("step", 1), ("ledger", 1), ("step", 2),
                                                            ("ledger", 2), ("step", 3)]
    monkeypatch.setattr(metrics_mod, "MAX_RECORDS", 4)
    m.record("step_done", {"step": 3})
    assert [(name, f["step"]) for name, f in m.records] == [("ledger", 1), ("step", 2), ("ledger", 2), ("step", 3)][
        1:] + [("step_done", 3)]
    events.close()
