"""Goodput attribution (elastic_ft.runevents.goodput) on hand-made event lists: every category, and the CLI."""

from __future__ import annotations

import json

import pytest

from elastic_ft import cli
from elastic_ft.runevents.goodput import CATEGORIES, attribute, find_events, process_start_time


def ev(ts: float, event: str, **fields) -> dict:
    return {"ts": ts, "event": event, **fields}


def done(ts: float, step: int, seconds: float = 1.0) -> dict:
    return ev(ts, "step_done", step=step, seconds=seconds)


def assert_partition(result):
    assert sum(result.seconds.values()) == pytest.approx(result.wall)


def test_one_clean_attempt():
    events = [
        ev(3.0, "start", agent_start=0.0, process_start=2.0),  # rendezvous 0..2
        ev(5.0, "resume_plan", step=0),                           # loading 2..5
        done(6.0, 1),                                             # kept 5..6
        done(7.5, 2),                                             # loop work 6..6.5 (kept), step 6.5..7.5
        ev(7.6, "checkpoint_committed", step=2),
        done(9.0, 3),                                             # blocked by the save at 2: 7.5..8
        ev(9.5, "checkpoint_committed", step=3),
        ev(10.0, "end", step=3),                                  # final flush of the save at 3: 9..10
    ]
    r = attribute(events)
    assert r.attempts == 1 and r.wall == pytest.approx(10.0)
    assert r.seconds == pytest.approx({"kept": 3.5, "redone": 0.0, "checkpoint": 1.5, "restart": 2.0, "loading": 3.0})
    assert r.goodput == pytest.approx(0.35)
    assert_partition(r)


def test_killed_then_resumed_from_an_earlier_checkpoint():
    events = [
        ev(0.5, "start", process_start=0.0),      # not under torchrun: the wall starts with the process
        ev(1.0, "resume_plan", step=0),
        done(2.0, 1), done(3.0, 2),
        ev(3.2, "checkpoint_committed", step=2),
        done(4.5, 3), done(5.5, 4),               # after the save at 2: 3..3.5 checkpoint, then lost steps
        # killed here: no end event
        ev(8.5, "start", process_start=8.0),      # 5.5..8 detection and restart
        ev(10.0, "resume_plan", step=2),          # 8..10 loading; steps 3 and 4 are trained again
        done(11.0, 3), done(12.0, 4),
        ev(12.2, "checkpoint_committed", step=4),
        ev(12.5, "end", step=4),
    ]
    r = attribute(events)
    assert r.attempts == 2 and r.wall == pytest.approx(12.5)
    assert r.seconds == pytest.approx({"kept": 4.0, "redone": 2.0, "checkpoint": 1.0, "restart": 2.5, "loading": 3.0})
    assert_partition(r)


def test_a_killed_attempts_tail_is_restart_and_a_preempted_ones_is_checkpoint():
    base = [ev(0.0, "start", process_start=0.0), ev(1.0, "resume_plan", step=0), done(2.0, 1)]
    killed = attribute([*base, ev(2.5, "checkpoint_committed", step=1), ev(4.0, "step", step=1)])
    assert killed.seconds["restart"] == pytest.approx(2.0)
    left = attribute([*base, ev(2.5, "spot_decision", step=1), ev(3.0, "checkpoint_committed", step=1),
                      ev(4.0, "preempted", step=1)])
    assert left.seconds["checkpoint"] == pytest.approx(2.0) and left.seconds["restart"] == 0.0
    for r in (killed, left):
        assert r.seconds["kept"] == pytest.approx(1.0) and r.seconds["loading"] == pytest.approx(1.0)
        assert_partition(r)


def test_an_attempt_lost_before_training_is_loading():
    r = attribute([ev(1.0, "start", process_start=0.0), ev(3.0, "resume_failed"),
                   ev(6.0, "start", process_start=5.0), ev(7.0, "resume_plan", step=0), done(8.0, 1),
                   ev(8.0, "end")])
    assert r.seconds == pytest.approx({"kept": 1.0, "redone": 0.0, "checkpoint": 0.0, "restart": 2.0, "loading": 5.0})


def test_steps_lost_twice_are_redone_each_time():
    events = [ev(0.0, "start", process_start=0.0), ev(0.0, "resume_plan", step=0), done(1.0, 1), done(2.0, 2),
              ev(2.0, "start", process_start=2.0), ev(2.0, "resume_plan", step=0), done(3.0, 1),
              ev(3.0, "start", process_start=3.0), ev(3.0, "resume_plan", step=0), done(4.0, 1), done(5.0, 2),
              ev(5.0, "end")]
    r = attribute(events)
    assert r.seconds["redone"] == pytest.approx(3.0) and r.seconds["kept"] == pytest.approx(2.0)


def test_times_going_backwards_add_nothing_and_the_sum_is_the_wall():
    events = [ev(2.0, "start", process_start=1.0), ev(1.5, "resume_plan", step=0), done(1.8, 1, seconds=5.0),
              done(3.0, 2), ev(2.9, "end")]
    r = attribute(events)
    assert r.wall == pytest.approx(2.0)
    assert all(v >= 0 for v in r.seconds.values())
    assert_partition(r)


def test_no_start_event_is_zero():
    r = attribute([done(1.0, 1)])
    assert r.attempts == 0 and r.wall == 0.0 and r.goodput == 0.0 and set(r.seconds) == set(CATEGORIES)


def test_process_start_time_of_this_process_is_in_the_past():
    import time

    t = process_start_time()
    assert t is not None and t <= time.time()
    assert process_start_time(2**22 + 12345) is None  # no such process


def test_cli_prints_the_table(tmp_path, capsys):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    events = [ev(0.0, "start", process_start=0.0), ev(1.0, "resume_plan", step=0), done(3.0, 1, seconds=2.0),
              ev(4.0, "end")]
    (logs / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert find_events(str(tmp_path / "run")) == str(logs / "events.jsonl")
    assert cli.main(["goodput", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "training (kept)" in out and "rendezvous and restart" in out and "goodput 75.0 %" in out


def test_cli_names_a_missing_run_in_one_line(tmp_path, capsys):
    assert cli.main(["goodput", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no events.jsonl" in err and "nowhere" in err
