"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import torch

from tests.ports import free_port


@pytest.fixture
def one_rank_gloo(monkeypatch):
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                            LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # init_world shares the host's cores out between local ranks
