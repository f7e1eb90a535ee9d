"""Goodput of a real run: killed under torchrun, resumed by the same command, then ``elastic-ft goodput``.

The run (the ``resumed_run`` fixture) is then read without its log directory, as when the machine that
led is lost: ``elastic-ft events``, ``status`` and ``goodput`` come from the run's store. (Attempts led from
different machines, numbered in the store, are the Batch rehearsal's and tests/checkpoint/test_runevents_store.py's.)
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.goodput import CATEGORIES, LABELS, attribute
from elastic_ft.runevents.load import load_run_events
from tests.conftest import cli, explain


def test_killed_and_resumed_run_accounts_for_its_wall_time(resumed_run, tmp_path):
    events = read_events(os.path.join(resumed_run, "logs", "events.jsonl"))
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and all(s["process_start"] and s["agent_start"] for s in starts)
    result = attribute(events)
    assert result.attempts == 2
    # Plotted as they are: each event names its attempt, so a step trained in both is two points, not one.
    assert [s["attempt"] for s in starts] == [1, 2]
    done = {(e["attempt"], e["step"]): e["ts"] for e in events if e["event"] == "step_done"}
    assert {s for a, s in done if a == 1} & {s for a, s in done if a == 2}, "no step was redone"
    # A step event, written in a batch at a flush, still carries the time its step ended.
    steps = [e for e in events if e["event"] == "step"]
    assert len({(e["attempt"], e["step"]) for e in steps}) == len(steps) >= 6
    assert all(abs(e["t_end"] - done[e["attempt"], e["step"]]) < 0.05 for e in steps)
    assert len({e["t_end"] for e in steps}) == len(steps)
    assert sum(result.seconds.values()) == pytest.approx(result.wall)
    assert result.wall == pytest.approx(events[-1]["ts"] - starts[0]["agent_start"])
    # Every category is there: a kept and a lost step, the final flush, the gap, the start-ups.
    assert all(result.seconds[c] > 0 for c in CATEGORIES), result.seconds

    # The run's location without its leaders' log directory, as when the machine that led is lost.
    run_root = str(tmp_path)
    shutil.copytree(resumed_run, os.path.join(run_root, "run"), ignore=shutil.ignore_patterns("logs"))
    shipped_events_of_the_run_outlive_the_leaders_machine(run_root, events)

    # goodput of the run's URI reads the store: both attempts, though the leaders' files are gone.
    uri = f"file://{run_root}/run"
    result = attribute(load_run_events(uri)[1])
    out = cli("goodput", uri)
    assert out.stdout.startswith(f"{uri}/events/"), explain(out)
    assert out.returncode == 0, explain(out)
    printed = {c: float(re.search(rf"^{re.escape(LABELS[c])}\s+([\d.]+)", out.stdout, re.M).group(1))
               for c in CATEGORIES}
    wall = float(re.search(r"^wall\s+([\d.]+)", out.stdout, re.M).group(1))
    assert sum(printed.values()) == pytest.approx(wall, abs=0.03)  # each row rounded to 0.01 s
    assert printed == pytest.approx(result.seconds, abs=0.006)
    assert f"goodput {100 * result.goodput:.1f} % over 2 attempt(s)" in out.stdout


def shipped_events_of_the_run_outlive_the_leaders_machine(run_root: str, events: list[dict]) -> None:
    """The leaders' machine (its events.jsonl) is lost; the run's store still has every step once."""
    uri = f"file://{run_root}/run"
    out = cli("events", uri)
    assert out.returncode == 0, explain(out)
    shipped = [json.loads(line) for line in out.stdout.splitlines()]
    resumed = next(e["step"] for e in shipped if e["event"] == "resume_plan" and e["attempt"] == 2)
    assert resumed >= 2
    for name in ("step", "step_done"):
        # Every step once: the first attempt's up to the checkpoint the second resumed from, then the second's.
        assert [(e["step"], e["attempt"]) for e in shipped if e["event"] == name] == [
            (s, 1 if s <= resumed else 2) for s in range(1, 7)], name
    assert [e["attempt"] for e in shipped if e["event"] == "start"] == [1, 2]
    assert [e["step"] for e in shipped if e["event"] == "checkpoint_committed" and e["attempt"] == 2][-1] == 6
    assert shipped[-1]["event"] == "end"
    # Every other event is one its leader wrote, once, in order: all of the second attempt's; of the first,
    # all that it shipped (before its commits, and what it could at its end).
    shipped_others, local_others = ([e for e in evs if e["event"] not in ("step", "step_done")] for evs in (shipped, events))
    assert shipped_others == [e for e in local_others if e in shipped_others]
    assert [e for e in local_others if e["attempt"] == 2] == [e for e in shipped_others if e["attempt"] == 2]
    assert [e["event"] for e in shipped_others if e["attempt"] == 1][:2] == ["start", "resume_plan"]
    only = cli("events", uri, "--event", "start", "--event", "end")
    assert [json.loads(line)["event"] for line in only.stdout.splitlines()] == ["start", "start", "end"]

    status = cli("status", uri)
    assert status.returncode == 0, explain(status)
    assert "steps: 6 of 6 (100.0 %); finished" in status.stdout, status.stdout
    assert re.search(r"^last checkpoint: step 6, committed \d+s ago", status.stdout, re.M), status.stdout
    assert "attempts: 2; rescales: 0; preemptions: 0 (and 0 exit(s) on SIGTERM); nodes lost: 0; attempts cut short: 1" in status.stdout
    assert "world: 2 rank(s)" in status.stdout and "ETA: done" in status.stdout
