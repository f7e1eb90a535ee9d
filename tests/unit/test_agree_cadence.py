"""The ranks' notice agreement runs about once every half second of steps, and at every boundary while a notice stands.

A one-rank gloo group (a file store in the test's directory, no other process)
makes the agreement a real all-reduce.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic_ft.config.sections import SpotConfig
from elastic_ft.runevents.events import EventLog
from elastic_ft.spot.watcher import LEVEL_LEAVE, LEVEL_NONE, Notice
from elastic_ft.train.preemption import AGREE_WITHIN_S, Preemption, agree_every
from elastic_ft.train.world import init_world


@pytest.mark.parametrize(
    "step_s, every",
    [(0.0, 1), (AGREE_WITHIN_S, 1), (5.0, 1), (0.125, 4), (0.15, 3), (0.3, 1), (0.001, 500)],
)
def test_agreements_are_about_half_a_second_of_steps_apart(step_s, every):
    assert agree_every(step_s) == every


@pytest.fixture
def preemption(tmp_path, monkeypatch):
    for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    p = Preemption(SpotConfig(enabled=False), init_world(), EventLog(None), endpoint="http://127.0.0.1:1")
    yield p
    p.close()
    dist.destroy_process_group()


def test_a_notice_is_agreed_on_within_half_a_second_of_steps_then_at_every_boundary(preemption):
    p = preemption
    assert p.world.distributed
    assert p.agree(None) == LEVEL_NONE  # before any step: agree now
    assert p.agree(0.125) == LEVEL_NONE  # agreed at 4 steps per half second: the next 3 boundaries skip
    p.board.post(Notice("terminate", None, 0.0, "t"))
    assert [p.agree(0.125) for _ in range(4)] == [LEVEL_NONE] * 3 + [LEVEL_LEAVE]
    assert [p.agree(0.125) for _ in range(3)] == [LEVEL_LEAVE] * 3  # while it stands, every boundary
