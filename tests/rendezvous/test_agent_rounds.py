"""The wrap of torch's agent round (:mod:`elastic_ft.rendezvous.agent_rounds`): which errors start a new round.

Pure logic on a stand-in for torch's ``_rendezvous`` (the real one is exercised end to end by
test_rdzv_lost_after_round.py): a lost writer means another round, anything else propagates, and past the
handler's join timeout a loss propagates too.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

from elastic_ft.rendezvous import agent_rounds
from elastic_ft.rendezvous.store import WritersLostError


def group(join_s: float) -> SimpleNamespace:
    handler = SimpleNamespace(settings=SimpleNamespace(timeout=SimpleNamespace(join=timedelta(seconds=join_s))),
                              get_run_id=lambda: "run")
    return SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler))


def wrapped(monkeypatch, outcomes: list) -> tuple:  # type: ignore[type-arg]
    """torch's _rendezvous replaced by one that raises or returns ``outcomes`` in turn, then wrapped."""
    calls = []

    def _rendezvous(self, worker_group):  # type: ignore[no-untyped-def]
        calls.append(worker_group)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(SimpleElasticAgent, "_rendezvous", _rendezvous)
    agent_rounds.rejoin_after_loss()
    return SimpleElasticAgent._rendezvous, calls


def test_a_lost_writer_starts_another_round(monkeypatch):
    rendezvous, calls = wrapped(monkeypatch, [WritersLostError("node x lost"), WritersLostError("node y lost"), "ok"])
    assert rendezvous(object(), group(60)) == "ok"
    assert len(calls) == 3


def test_other_errors_propagate_at_once(monkeypatch):
    rendezvous, calls = wrapped(monkeypatch, [dist.DistStoreError("Wait timeout"), "ok"])
    with pytest.raises(dist.DistStoreError, match="Wait timeout"):
        rendezvous(object(), group(60))
    assert len(calls) == 1


def test_a_loss_past_the_join_timeout_propagates(monkeypatch):
    rendezvous, calls = wrapped(monkeypatch, [WritersLostError("node x lost"), "ok"])
    with pytest.raises(WritersLostError):
        rendezvous(object(), group(-1))  # the deadline has passed before the first loss
    assert len(calls) == 1


def test_a_torch_whose_agent_round_changed_is_left_alone(monkeypatch, caplog):
    def _rendezvous(self, worker_group, extra):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    monkeypatch.setattr(SimpleElasticAgent, "_rendezvous", _rendezvous)
    agent_rounds.rejoin_after_loss()
    assert SimpleElasticAgent._rendezvous is _rendezvous
    assert "no _rendezvous(self, worker_group)" in caplog.text
