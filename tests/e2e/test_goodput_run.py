"""Goodput of a real run: killed under torchrun, resumed by the same command, then ``elastic-ft goodput``."""

from __future__ import annotations

import os
import re

import pytest

from elastic_ft.events import read_events
from elastic_ft.goodput import CATEGORIES, LABELS, attribute
from tests.conftest import cli, explain


def test_killed_and_resumed_run_accounts_for_its_wall_time(resumed_run):
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

    out = cli("goodput", resumed_run)
    assert out.returncode == 0, explain(out)
    printed = {c: float(re.search(rf"^{re.escape(LABELS[c])}\s+([\d.]+)", out.stdout, re.M).group(1))
               for c in CATEGORIES}
    wall = float(re.search(r"^wall\s+([\d.]+)", out.stdout, re.M).group(1))
    assert sum(printed.values()) == pytest.approx(wall, abs=0.03)  # each row rounded to 0.01 s
    assert printed == pytest.approx(result.seconds, abs=0.006)
    assert f"goodput {100 * result.goodput:.1f} % over 2 attempt(s)" in out.stdout
