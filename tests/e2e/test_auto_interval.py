"""checkpoint.every_steps: auto in a real torchrun job: the interval shortens once the run has lost an attempt.

The first attempt has no loss behind it: the leader chooses from the prior MTBF (checkpoint.auto_mtbf_s,
an hour) and the interval is far beyond the run. A worker SIGKILLed mid-run costs the attempt (torchrun
restarts both workers); the new leader reads the run's attempts from the store, counts the loss over the
seconds the run had trained, and chooses a much shorter interval, agreed by both ranks at a step
boundary: the saves that follow land on its multiples, both ranks taking part.
"""

from __future__ import annotations

import os
import re

import pytest

from elastic_ft.runevents.events import read_events
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

STEPS = 60


def test_the_interval_shortens_after_a_loss(run_root):
    args = ["--spec", DEFAULT_SPEC, "--run_id", "auto", "--checkpoint_uri", f"file://{run_root}",
            "--log_dir", os.path.join(run_root, "auto", "logs"), f"steps={STEPS}", "checkpoint.every_steps=auto",
            "logging.every_steps=10", "checkpoint.keep_last=null"]
    env = process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ELASTIC_FT_FAULTS="kill:rank=1,step=12,restart=0")
    proc = torchrun(2, args, max_restarts=1, env=env)
    assert proc.returncode == 0, explain(proc)
    events = read_events(os.path.join(run_root, "auto", "logs", "events.jsonl"))
    assert [e["restart"] for e in events if e["event"] == "start"] == [0, 1], "torchrun did not restart once"

    changes = [e for e in events if e["event"] == "checkpoint_interval"]
    first = [e for e in changes if e["attempt"] == 1]
    second = [e for e in changes if e["attempt"] == 2]
    assert first and second, changes
    # Each attempt's first choice: no interval before it.
    assert first[0]["old"] is None and second[0]["old"] is None
    assert "no loss in" in first[0]["reason"] and "prior 60 min" in first[0]["reason"], first[0]
    assert first[0]["new"] > STEPS, first[0]  # an hour's prior: far beyond this run
    assert "1 loss in" in second[0]["reason"], second[0]
    assert second[0]["new"] < first[0]["new"] / 3, (first[0], second[0])
    assert all(e["new"] != e["old"] for e in changes)

    # The saves of the second attempt follow an interval the ranks agreed, at its multiples, on both ranks
    # (the commit event may land after the next change: its reason names the interval the save followed).
    agreed = {e["new"] for e in second}
    auto_saves = [(e["step"], int(m.group(1)), e["parts"]) for e in events
                  if e["event"] == "checkpoint_committed" and e["attempt"] == 2
                  and (m := re.fullmatch(r"every (\d+) steps \(auto\)", e["reason"]))]
    assert auto_saves, [e for e in events if e["event"] == "checkpoint_committed"]
    assert all(every in agreed and step % every == 0 and parts == 2 for step, every, parts in auto_saves), \
        (auto_saves, agreed)
    assert events[-1]["event"] == "end" and events[-1]["step"] == STEPS
