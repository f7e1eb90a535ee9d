"""Malformed stored events (elastic_ft.runevents.schema): every reader skips and counts them, never a traceback.

A run's events are read back by ``status``, ``events``, ``goodput``, ``plot``, the ledger replay, the
merge of shipped batches and the TensorBoard sink. Each malformed event below broke at least one of
them (``status`` ended in ``KeyError: 'step'`` on the first); each command now reports the count once.
"""

from __future__ import annotations

import json
import logging

import pytest

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.cli import main
from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.goodput import attribute
from elastic_ft.runevents.layout import batch_key
from elastic_ft.runevents.ledger import replay
from elastic_ft.runevents.merge import latest_steps, merge
from elastic_ft.runevents.schema import problem, screen
from elastic_ft.runevents.status import summary
from elastic_ft.viz.series import run_series


def _good() -> list[dict]:
    """A small clean run: one attempt, three steps, a checkpoint, the end."""
    out = [{"ts": 10.0, "event": "start", "attempt": 1, "world": 2, "total_steps": 3, "process_start": 9.0},
           {"ts": 11.0, "event": "resume_plan", "attempt": 1, "step": 0, "reason": "fresh start"}]
    for s in (1, 2, 3):
        out += [{"ts": 11.0 + s, "event": "step_done", "attempt": 1, "step": s, "seconds": 0.9},
                {"ts": 11.0 + s, "event": "ledger", "attempt": 1, "step": s - 1, "samples": [[[0, 2 * s]], [[0, 2 * s + 1]]]},
                {"ts": 11.0 + s, "event": "step", "attempt": 1, "step": s, "loss": 2.0 / s, "lr": 0.1, "t_end": 11.0 + s,
                 "tokens_per_s": 100.0, "world": 2, "eta_s": 3.0 - s}]
    out += [{"ts": 14.5, "event": "checkpoint_committed", "attempt": 1, "step": 3, "seconds": 0.2},
            {"ts": 15.0, "event": "end", "attempt": 1, "step": 3}]
    return out


# Each breaks a reader of the old code (KeyError, TypeError, ValueError or AttributeError).
MALFORMED = {
    "step without step": {"ts": 12.5, "event": "step", "attempt": 1, "loss": 1.0},
    "step_done without seconds": {"ts": 12.5, "event": "step_done", "attempt": 1, "step": 2},
    "resume_plan with a text step": {"ts": 12.5, "event": "resume_plan", "attempt": 1, "step": "two"},
    "ledger with flat samples": {"ts": 12.5, "event": "ledger", "attempt": 1, "step": 1, "samples": [[0, 1]]},
    "start without ts": {"event": "start", "attempt": 1},
    "a list, not an object": [1, 2, 3],
    "attempt as text": {"ts": 12.5, "event": "rescale", "attempt": "x", "step": 1},
    "checkpoint with a null step": {"ts": 12.5, "event": "checkpoint_committed", "attempt": 1, "step": None},
    "rescale whose change is a number": {"ts": 12.5, "event": "rescale", "attempt": 1, "step": 1, "changed": {"w": 3}},
}


def _with(bad) -> list:
    good = _good()
    return good[:5] + [bad] + good[5:]


def test_the_clean_run_is_well_formed():
    assert [problem(e) for e in _good()] == [None] * len(_good())
    assert screen(_good()).skipped == 0


@pytest.mark.parametrize("name", MALFORMED)
def test_every_pure_reader_skips_a_malformed_event(name):
    events = _with(MALFORMED[name])
    assert problem(MALFORMED[name]) is not None
    clean = _good()
    # the same answers as without the bad event: it is left out, not half read
    assert attribute(events) == attribute(clean)
    assert run_series(events) == run_series(clean)
    assert replay(events) == replay(clean)
    assert latest_steps(events) == clean and latest_steps(events).skipped == 1
    assert summary("r", events, None, committed=0, now=20.0) == summary("r", clean, None, committed=0, now=20.0)


def test_a_step_event_without_its_step_is_named():
    assert problem(MALFORMED["step without step"]) == "a 'step' event without 'step' (a whole number >= 0)"
    assert problem(MALFORMED["a list, not an object"]) == "not a JSON object but list"
    assert problem(MALFORMED["resume_plan with a text step"]) == (
        "a 'resume_plan' event whose 'step' is 'two', not a whole number >= 0")


def _ship(run_dir, lines: list[str]) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    LocalStore(str(run_dir)).put(batch_key(1, 0, "w"), "\n".join(lines).encode() + b"\n")
    return f"file://{run_dir}"


def _lines_with_bad() -> list[str]:
    lines = [json.dumps(e) for e in _good()]
    # a step event without "step" (status: KeyError), a torn line, a list
    return lines[:5] + [json.dumps(MALFORMED["step without step"]), '{"ts": 12.6, "ev', "[1, 2]"] + lines[5:]


@pytest.mark.parametrize("command", [["status"], ["events"], ["events", "--all"], ["goodput"], ["plot"]])
def test_each_command_reports_the_skipped_events_once(tmp_path, capsys, command):
    uri = _ship(tmp_path / "r1", _lines_with_bad())
    extra = ["--out", str(tmp_path / "run.png")] if command == ["plot"] else []
    assert main([*command, uri, *extra]) == 0
    out, err = capsys.readouterr()
    source = f"{uri}/events/"
    assert err.splitlines() == [
        f"elastic-ft: skipped 3 malformed event(s) in {source} (the first: {batch_key(1, 0, 'w')} line 6: "
        f"a 'step' event without 'step' (a whole number >= 0)); the rest is read as usual"]
    if command == ["status"]:
        assert "steps: 3 of 3 (100.0 %); finished" in out
    if command[0] == "events":
        assert len(out.splitlines()) == len(_good())


def test_a_local_events_file_counts_its_lines(tmp_path, capsys):
    logs = tmp_path / "r2" / "logs"
    logs.mkdir(parents=True)
    (logs / "events.jsonl").write_text("\n".join(_lines_with_bad()) + "\n")
    events = read_events(str(logs / "events.jsonl"))
    assert events == _good() and events.skipped == 3
    assert events.first == "line 6: a 'step' event without 'step' (a whole number >= 0)"
    assert main(["goodput", str(tmp_path / "r2")]) == 0
    assert "skipped 3 malformed event(s)" in capsys.readouterr().err


def test_merge_counts_what_it_skips_across_batches():
    lines = _lines_with_bad()
    merged = merge([(batch_key(1, 0, "w"), "\n".join(lines[:6])), (batch_key(1, 6, "w"), "\n".join(lines[6:]))])
    assert merged == _good() and merged.skipped == 3
    assert merged.first == f"{batch_key(1, 0, 'w')} line 6: a 'step' event without 'step' (a whole number >= 0)"


def test_the_tensorboard_sink_skips_and_counts(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    from elastic_ft.viz.tensorboard import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path / "tb"))
    with caplog.at_level(logging.WARNING, logger="elastic_ft.viz.tensorboard"):
        for e in _with({"ts": 12.5, "event": "resume_plan", "attempt": 1}):
            sink.write(e)
        sink.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"TensorBoard: skipped 1 malformed event(s) in what was sent to TensorBoard at {tmp_path / 'tb'} "
        f"(the first: record 'resume_plan': a 'resume_plan' event without 'step' (a whole number >= 0)); "
        f"the rest is read as usual"]
