"""``checkpoint.every_seconds`` is decided by the leader's clock, agreed in the step boundary's int all-reduce.

The ranks' clocks differ, so the leader's decides; it used to be sent with ``broadcast_object_list`` after
every step (a pickle and two broadcasts per step on NCCL). Now the leader's checkpoint age travels in the
notice agreement's all-reduce (:meth:`Preemption.agree`): no object collective per step, and every rank
reads the same age, so ``checkpoint_due`` picks the same steps on every rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from elastic_ft.config import load_spec
from elastic_ft.train import loop
from tests.conftest import DEFAULT_SPEC
from tests.ports import free_port


def test_every_seconds_costs_no_object_broadcast_per_step(monkeypatch, tmp_path, one_rank_gloo):
    broadcasts: list[int] = []
    at_step: list[int] = []  # object broadcasts made so far, as each step starts
    real_broadcast, real_step = dist.broadcast_object_list, loop.Trainer.step_once
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **k: broadcasts.append(1) or real_broadcast(*a, **k))

    def step_once(self):
        at_step.append(len(broadcasts))
        return real_step(self)

    monkeypatch.setattr(loop.Trainer, "step_once", step_once)
    # A time rule that is never due in this run, and no other save: nothing to broadcast after resume.
    spec = load_spec(DEFAULT_SPEC, ["steps=5", "batch.global_batch=4", "batch.micro_batch=4",
                                    "checkpoint.every_steps=null", "checkpoint.every_seconds=3600",
                                    "checkpoint.save_final=false", "logging.every_steps=5"])
    opts = loop.RunOptions(run_id="clock", checkpoint_uri=f"file://{tmp_path}", log_dir=str(tmp_path / "logs"))
    assert loop.run(spec, opts)["step"] == 5
    assert len(at_step) == 5 and len(set(at_step)) == 1, f"object broadcasts before each step: {at_step}"
    assert len(broadcasts) == at_step[0], "a broadcast_object_list after the steps began"


RANK = """
import os, sys
from elastic_ft.config.sections import CheckpointConfig, SpotConfig
from elastic_ft.runevents.events import EventLog
from elastic_ft.train.cadence import checkpoint_due
from elastic_ft.train.preemption import Preemption
from elastic_ft.train.world import close_world, init_world
rank = int(os.environ["RANK"])
world = init_world()
p = Preemption(SpotConfig(enabled=False), world, EventLog(None), endpoint="http://127.0.0.1:1")
cfg = CheckpointConfig(every_steps=None, every_seconds=1.0, save_final=False)
# Each rank's own clock disagrees with the other's at every boundary: rank 1 always says due, rank 0 alternates.
ages = [0.5, 2.0, 0.25, 30.0] if rank == 0 else [9.0, 0.0, 9.0, 0.0]
out = []
for step, age in enumerate(ages + ages, 1):
    step_s = 1.0 if step <= len(ages) else 0.1  # then agreements 5 boundaries apart: in between, no age
    p.agree(step_s, checkpoint_age_s=age)
    out.append((p.checkpoint_age_s, checkpoint_due(step=step, total_steps=100, last_step=0,
                                                   seconds_since=p.checkpoint_age_s, cfg=cfg)[0]))
print(out, flush=True)
p.close()
close_world(world)
"""


@pytest.mark.torchrun
def test_the_leaders_clock_decides_at_the_same_boundaries_on_every_rank():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       LOCAL_WORLD_SIZE="2"))
             for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank is stuck: the ranks made different collectives")
        assert p.returncode == 0, err
        outs.append(out)
    assert outs[0] == outs[1], outs  # the same age and decision at every boundary, on both ranks
    agreed = eval(outs[0])  # noqa: S307  (our own script's printed list of tuples)
    leader = [(0.5, False), (2.0, True), (0.25, False), (30.0, True)]
    # Agreed each boundary at 1 s steps; at 0.1 s steps the first agrees, the next four do not (no age: not due).
    assert agreed == leader + [(0.5, False), (None, False), (None, False), (None, False)], agreed
