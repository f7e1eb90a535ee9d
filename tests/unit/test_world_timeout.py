"""The process group's timeout comes from spot.collective_timeout_s, not torch's 30-minute default."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_ft.config import load_spec
from elastic_ft.train.world import close_world, init_world
from tests.conftest import DEFAULT_SPEC
from tests.ports import free_port


def test_the_process_group_waits_as_long_as_the_spec_says(monkeypatch):
    spec = load_spec(DEFAULT_SPEC, ["spot.collective_timeout_s=42"])
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                            LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    world = init_world(timedelta(seconds=spec.spot.collective_timeout_s))
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=42)
    finally:
        close_world(world)


def test_the_default_is_bounded_well_below_torchs():
    assert load_spec(DEFAULT_SPEC, []).spot.collective_timeout_s == 600
