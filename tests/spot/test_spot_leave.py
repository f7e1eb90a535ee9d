"""The leave marker and its pure rules (no processes): who leaves, where the agent honours it, whose it is."""

from __future__ import annotations

import os

import pytest

from elastic_ft.spot.leave import (
    AT_EXIT,
    AT_ROUND,
    LEAVE_FILE_ENV,
    LeaveMarker,
    clear_marker,
    honoured,
    leaving_nodes,
    marker_for_worker,
    marker_path,
    note_peer_lost,
    peer_lost,
    read_marker,
    write_marker,
)
from elastic_ft.spot.watcher import LEVEL_LEAVE, LEVEL_NONE, LEVEL_REBALANCE
from elastic_ft.train.preemption import Preempted


def test_a_node_leaves_when_any_of_its_ranks_holds_a_leave_notice():
    reports = [("0", [LEVEL_NONE]), ("0", [LEVEL_LEAVE]), ("1", [LEVEL_REBALANCE]), ("2", []),
               ("3", [LEVEL_REBALANCE, LEVEL_LEAVE])]
    assert leaving_nodes(reports) == {"0", "3"}
    assert leaving_nodes([("0", [LEVEL_REBALANCE])]) == frozenset()


@pytest.mark.parametrize("kind", ["terminate", "stop", "hibernate"])
def test_an_imds_notice_leaves_wherever_the_agent_reads_it(kind):
    marker = LeaveMarker(kind=kind, step=7)
    assert honoured(marker, AT_ROUND) and honoured(marker, AT_EXIT)


def test_a_sigterm_leaves_only_at_exit_since_before_a_round_it_was_the_agents_own_restart():
    marker = LeaveMarker(kind="sigterm", step=7)
    assert not honoured(marker, AT_ROUND)
    assert honoured(marker, AT_EXIT)
    assert not honoured(None, AT_EXIT)


@pytest.mark.parametrize("kind", ["terminate", "sigterm"])
def test_the_marker_of_a_node_that_stays_never_makes_its_agent_leave(kind, tmp_path):
    marker = LeaveMarker(kind=kind, step=7, stays=True, leaving=(0, 2))  # the ranks of the nodes that go
    assert not honoured(marker, AT_ROUND) and not honoured(marker, AT_EXIT)
    path = marker_path("r", root=str(tmp_path))
    write_marker(path, marker)
    assert read_marker(path) == marker


def test_the_lost_peer_note_lies_beside_the_marker_and_clears_with_it(tmp_path):
    path = marker_path("r", root=str(tmp_path))
    assert not peer_lost(path)
    note_peer_lost(path)
    assert peer_lost(path) and read_marker(path) is None  # a note, not a leave
    clear_marker(f"{path}.lost")
    assert not peer_lost(path)


def test_the_marker_round_trips_and_clears(tmp_path):
    path = marker_path("run/with:odd chars", root=str(tmp_path))
    assert os.path.dirname(os.path.dirname(path)) == str(tmp_path)
    assert "/" not in os.path.basename(path).replace("run_with_odd_chars", "")
    assert read_marker(path) is None
    write_marker(path, LeaveMarker(kind="terminate", step=12))
    assert read_marker(path) == LeaveMarker(kind="terminate", step=12)
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp file left
    clear_marker(path)
    clear_marker(path)  # clearing twice is fine
    assert read_marker(path) is None


def test_an_unreadable_marker_is_no_leave(tmp_path):
    path = marker_path("r", root=str(tmp_path))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    assert read_marker(path) is None


def test_each_agent_gets_its_own_path_so_an_old_marker_never_reaches_a_new_agent(tmp_path):
    assert marker_path("r", root=str(tmp_path)) != marker_path("r", root=str(tmp_path))


def test_only_a_torchrun_worker_of_the_agent_named_in_the_path_writes_the_marker(tmp_path):
    path = marker_path("run.1", root=str(tmp_path))  # this process plays the agent
    worker = {LEAVE_FILE_ENV: path, "TORCHELASTIC_RUN_ID": "run.1"}
    assert marker_for_worker(worker, os.getpid()) == path
    # A process that built a handler passes the variable on to all it starts: none of them may write
    # unless it is that agent's torchrun worker of the same run.
    assert marker_for_worker(worker, os.getpid() + 1) is None
    assert marker_for_worker({LEAVE_FILE_ENV: path}, os.getpid()) is None
    assert marker_for_worker(dict(worker, TORCHELASTIC_RUN_ID="run.2"), os.getpid()) is None
    assert marker_for_worker({"TORCHELASTIC_RUN_ID": "run.1"}, os.getpid()) is None
    assert marker_for_worker(dict(worker, **{LEAVE_FILE_ENV: "/tmp/x.json"}), os.getpid()) is None


def test_a_worker_stopped_by_sigterm_does_not_call_itself_preempted():
    # torchrun also SIGTERMs its workers to restart them for a node that joins: no spot reclaim.
    assert str(Preempted(9, "sigterm")).startswith("stopped by SIGTERM at step 9, state committed")
    assert "preempted" not in str(Preempted(9, "sigterm")) and "step 10" in str(Preempted(9, "sigterm"))
    assert str(Preempted(9, "terminate")).startswith("preempted: left on a terminate notice at step 9")
    assert str(Preempted(9, "sigterm", stays=True)).startswith("other node(s) left on a sigterm notice")
