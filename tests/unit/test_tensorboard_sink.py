"""``logging.tensorboard``: the EventLog sink written with torch's SummaryWriter and read back with
TensorBoard's own EventAccumulator (a real event file in a temporary directory), its failure modes, and
the spec's check that the package is installed."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from elastic_ft.config import ConfigError, load_spec
from elastic_ft.runevents.events import EventLog
from elastic_ft.viz.tensorboard import TensorBoardSink
from tests.conftest import DEFAULT_SPEC


def accumulate(path: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path)
    acc.Reload()
    return acc


def texts(acc, tag: str) -> list[tuple[int, str]]:
    """(step, text) of a tag add_text wrote (TensorBoard keeps text as a string tensor)."""
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def attempt(tb: str, number: int, resume_from: int, steps: list[tuple[int, float]], *more: tuple) -> None:
    """One attempt's leader: an EventLog with the sink, as the trainer wires it."""
    log = EventLog(None, run_id="r", attempt=number)
    log.add_sink(TensorBoardSink(tb))
    log.emit("start", world=2)
    log.emit("resume_plan", step=resume_from)
    for name, fields in more:
        log.emit(name, **fields)
    for n, loss in steps:
        log.emit("step", step=n, t_end=1000.0 + n, loss=loss, lr=1e-3, tokens_per_s=50.0 * n, world=2)
    log.emit("checkpoint_committed", step=steps[-1][0], seconds=0.25)
    log.close()


def test_steps_redone_after_a_restart_show_once_with_the_kept_try(tmp_path):
    tb = str(tmp_path / "tensorboard")
    attempt(tb, 1, 0, [(1, 5.0), (2, 4.8), (3, 4.6)])
    attempt(tb, 2, 2, [(3, 4.55), (4, 4.4)],
            ("rescale", {"step": 2, "changed": {"world": {"old": 2, "new": 1}}, "reason": "world changed"}),
            ("node_lost", {"reason": "node b left", "resume_after_step": 2, "world": 1}))
    assert len(os.listdir(tb)) == 2  # one event file per attempt
    acc = accumulate(tb)
    loss = [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 5.0), (2, 4.8), (3, 4.55), (4, 4.4)]  # step 3 of attempt 1 purged
    assert [(e.step, e.value) for e in acc.Scalars("train/tokens_per_s")] == [(n, 50.0 * n) for n in (1, 2, 3, 4)]
    assert [e.wall_time for e in acc.Scalars("train/world")] == [1001.0, 1002.0, 1003.0, 1004.0]  # when it ended
    assert {e.step for e in acc.Scalars("train/lr")} == {1, 2, 3, 4}
    assert [e.step for e in acc.Scalars("checkpoint/seconds")] == [4]  # attempt 1's at 3: past the resume, purged
    assert texts(acc, "events/rescale") == [(2, "rescale at step 2: world 2 -> 1 (world changed)")]
    assert texts(acc, "events/preemption") == [(2, "node_lost: reason node b left, resume_after_step 2, world 1")]


def test_a_sink_that_cannot_write_warns_once_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = EventLog(str(tmp_path / "events.jsonl"), run_id="r", attempt=1)
    log.add_sink(TensorBoardSink(str(blocker / "tensorboard")))
    with caplog.at_level(logging.WARNING, logger="elastic_ft.viz.tensorboard"):
        for n in (1, 2):
            log.emit("step", step=n, t_end=1.0, loss=1.0, lr=1e-3, tokens_per_s=1.0, world=1)
    log.close()
    assert len([r for r in caplog.records if "TensorBoard: cannot write" in r.getMessage()]) == 1
    assert (tmp_path / "events.jsonl").read_text().count('"event": "step"') == 2


def test_sinks_see_every_record_in_order_and_are_closed_with_the_log():
    seen, closed = [], []

    class Sink:
        def write(self, record, line):
            seen.append(record["event"])
            assert json.loads(line) == record

        def close(self):
            closed.append(True)

    log = EventLog(None, run_id="r", attempt=1)
    log.emit("start", quiet=True)  # before the sink: not passed
    log.add_sink(Sink())
    log.emit("resume_plan", quiet=True, step=0)
    log.emit("step", quiet=True, step=1)
    log.close()
    assert (seen, closed) == (["resume_plan", "step"], [True])


def test_tensorboard_without_its_package_is_a_spec_error_naming_the_field_and_the_extra(monkeypatch):
    assert load_spec(DEFAULT_SPEC, ["logging.tensorboard=true"]).logging.tensorboard is True
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # find_spec answers None: as if not installed
    with pytest.raises(ConfigError) as err:
        load_spec(DEFAULT_SPEC, ["logging.tensorboard=true"])
    assert err.value.problems == [("logging.tensorboard", "needs the tensorboard package, which is not installed: "
                                                          "pip install 'elastic-ft[tensorboard]'")]
    assert load_spec(DEFAULT_SPEC, []).logging.tensorboard is False  # off: nothing is checked
    with pytest.raises(ConfigError) as err:
        load_spec(DEFAULT_SPEC, ["logging.tensorboard=sometimes"])
    assert err.value.problems[0][0] == "logging.tensorboard"


def test_eval_losses_are_a_scalar_at_their_step(tmp_path):
    tb = str(tmp_path / "tensorboard")
    attempt(tb, 1, 0, [(1, 5.0), (2, 4.8)], ("eval", {"step": 2, "loss": 4.9, "tokens": 700, "samples": 64}),
            ("eval", {"step": 4, "loss": "nan", "tokens": 700, "samples": 64}))  # a NaN loss is left out
    acc = accumulate(tb)
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("eval/loss")] == [(2, 4.9)]
