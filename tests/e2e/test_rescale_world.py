"""``scale_with_world`` across a change of world: a real run at world 2, lost, resumed at world 1.

After the change, the ``rescale`` event states the old and new plan and the
steps actually trained follow the chosen rule: the global batch halves (the
per-rank batch is fixed) and the LR is multiplied by 1/sqrt(2) (sqrt) against
the reference world 2.
"""

from __future__ import annotations

import math
import os

import pytest

from elastic_ft.runevents.events import read_events
from elastic_ft.runevents.ledger import check_exactly_once, replay
from tests.conftest import DEFAULT_SPEC, explain, process_env, torchrun
from tests.e2e.conftest import train

LR, PER_RANK, REFERENCE = 1e-3, 8, 2
pytestmark = pytest.mark.torchrun

COMMON = ["steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=null", "logging.ledger=true",
          "logging.every_steps=1", "optimizer.schedule=constant", "optimizer.warmup_steps=0", f"optimizer.lr={LR}",
          "batch.policy=scale_with_world", f"batch.global_batch={PER_RANK * REFERENCE}", f"batch.micro_batch=4",
          f"batch.reference_world={REFERENCE}"]


# One rule end to end: sqrt. What the trainer does with a plan (train the new global batch at the new LR) does
# not depend on the rule, and each rule's plan and rescale event are unit tests (tests/unit/test_scaling.py,
# both rules). Linear's factor here, 1/2, would equal the batch ratio: a trainer that scaled the LR by the
# batch would pass with it; sqrt's 1/sqrt(2) tells the two apart.
def test_lr_and_global_batch_follow_the_rule_after_a_change_of_world(run_root):
    rule, factor = "sqrt", math.sqrt(0.5)
    overrides = [*COMMON, f"batch.lr_scaling={rule}"]
    logs = os.path.join(run_root, "run", "logs")
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{run_root}", "--log_dir", logs,
            *overrides]
    # World 2 until rank 0 is SIGKILLed at the start of step 5 (no restarts: the job dies) ...
    first = torchrun(2, args, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                              ELASTIC_FT_FAULTS="kill:rank=0,step=5"))
    assert first.returncode != 0, "the injected kill did not stop the world-2 attempt"
    # ... then the same command at world 1, in this process.
    assert train(run_root, "run", *overrides) == 0

    events = read_events(os.path.join(logs, "events.jsonl"))
    resumed = [e for e in events if e["event"] == "resume_plan"][-1]
    assert resumed["step"] in (2, 4), resumed  # the newest save committed before the kill (asynchronous)
    rescales = [e for e in events if e["event"] == "rescale"]
    assert len(rescales) == 1, rescales  # one event for the one change of world
    ev = rescales[0]
    assert ev["step"] == resumed["step"] and ev["policy"] == "scale_with_world"
    assert (ev["old"]["world"], ev["new"]["world"]) == (2, 1)
    assert (ev["old"]["global_batch"], ev["new"]["global_batch"]) == (PER_RANK * 2, PER_RANK)
    assert (list(ev["old"]["per_rank"]), list(ev["new"]["per_rank"])) == ([PER_RANK] * 2, [PER_RANK])
    assert list(ev["new"]["micro_steps"]) == [PER_RANK // 4]
    assert ev["old"]["lr_factor"] == pytest.approx(1.0) and ev["new"]["lr_factor"] == pytest.approx(factor)
    assert ev["new"]["lr"] == pytest.approx(LR * factor)

    # What was trained follows the event: the steps of the final history, before and after the change.
    history = replay(events)
    assert sorted(history) == list(range(6))
    assert check_exactly_once(history, 1024) == []
    assert [len(history[s]) for s in range(6)] == [16 if s < resumed["step"] else 8 for s in range(6)]
    after = [e for e in events[events.index(resumed):] if e["event"] == "step"]
    assert [e["step"] for e in after] == list(range(resumed["step"] + 1, 7))
    assert all(e["world"] == 1 and e["lr"] == pytest.approx(LR * factor) for e in after), after
    before = [e for e in events[:events.index(resumed)] if e["event"] == "step"]
    assert before and all(e["lr"] == pytest.approx(LR) for e in before), before
