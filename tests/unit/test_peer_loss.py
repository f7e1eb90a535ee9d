"""The resume line after a lost node, and what the agent hands its workers for it."""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

from elastic_ft.runevents.events import EventLog
from elastic_ft.rendezvous.lifecycle import departed
from elastic_ft.handoff.leave_marker import LeaveMarker
from elastic_ft.handoff.lost_nodes import LOST_NODES_ENV
from elastic_ft.train.peer_loss import announce, collective_failure

A, B = _NodeDesc("host", 1, 0), _NodeDesc("host", 2, 0)


def test_a_round_without_a_previous_member_names_it():
    reason = departed((4, {A, B}), {A})
    assert reason is not None and str(B) in reason and str(A) not in reason and "round 4" in reason


def test_a_node_that_left_on_a_spot_notice_is_named_with_the_notice_not_as_a_crash():
    reason = departed((4, {A, B}), {A}, LeaveMarker(kind="terminate", step=31, stays=True))
    assert reason == f"node(s) {B} of round 4 left on a spot terminate notice, step 31 committed"


def test_a_first_round_or_a_grown_one_names_nobody():
    assert departed(None, {A}) is None
    assert departed((4, {A}), {A, B}) is None


def test_announce_is_one_event_and_one_line_on_local_rank_0(tmp_path, caplog):
    events = EventLog(str(tmp_path / "events.jsonl"))
    env = {LOST_NODES_ENV: "node(s) host_2_0 (keep-alive expired: last heartbeat 7 s ago) of round 3 lost"}
    with caplog.at_level(logging.INFO):
        line = announce(events, step=12, world=3, local_rank=0, environ=env)
    events.close()
    assert line == (env[LOST_NODES_ENV] + "; the job resumes after step 12 (the last committed) at world size 3")
    assert [r.getMessage() for r in caplog.records] == [line]
    record = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(record) == 1 and '"event": "node_lost"' in record[0] and '"resume_after_step": 12' in record[0]


def test_announce_is_silent_without_a_loss_and_on_other_local_ranks(caplog):
    events = EventLog(None)
    with caplog.at_level(logging.INFO):
        assert announce(events, step=1, world=2, local_rank=0, environ={}) is None
        assert announce(events, step=1, world=2, local_rank=1, environ={LOST_NODES_ENV: "x"}) is not None
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:11663: Connection reset by peer. This is typically caused by a remote worker hanging")


def test_a_gloo_transport_error_is_one_line_without_gloos_path():
    assert collective_failure(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:11663: Connection reset by peer"


def test_torchs_distributed_errors_are_collective_failures():
    import torch.distributed as dist

    assert collective_failure(dist.DistBackendError("NCCL watchdog timeout\nmore")) == (
        "DistBackendError: NCCL watchdog timeout")
    assert collective_failure(dist.DistStoreError("wait timeout")) is not None


def test_any_other_error_keeps_its_traceback():
    assert collective_failure(RuntimeError("shape mismatch")) is None
    assert collective_failure(ValueError(GLOO_RESET)) is None
    assert collective_failure(KeyError("x")) is None
