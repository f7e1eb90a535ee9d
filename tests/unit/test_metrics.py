"""Step metrics (elastic_ft.train.metrics) on a single process: what is reported, and when."""

import torch

from elastic_ft.events import EventLog, read_events
from elastic_ft.train.metrics import Metrics, StepResult, fmt_eta, number
from elastic_ft.train.world import World


def _metrics(tmp_path, *, total_steps=5, every_steps=2):
    world = World(rank=0, size=1, local_rank=0, local_size=1, device=torch.device("cpu"))
    events = EventLog(str(tmp_path / "events.jsonl"), run_id="r")
    return Metrics(world, events, total_steps=total_steps, every_steps=every_steps), events


def _step(step, loss_sum, tokens, skipped=None):
    return StepResult(step, 1e-3, tokens, None, torch.tensor(loss_sum, dtype=torch.float64), seconds=0.5,
                      skipped=skipped)


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
