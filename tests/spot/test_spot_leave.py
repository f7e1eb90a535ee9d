"""The leave marker and its pure rules (no processes): who leaves, where the agent honours it, whose it is."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

import pytest

from elastic_ft.handoff.leave_marker import (
    AT_EXIT,
    AT_ROUND,
    LEAVE_FILE_ENV,
    LeaveMarker,
    clear_marker,
    honoured,
    marker_for_worker,
    marker_path,
    note_peer_lost,
    peer_lost,
    read_marker,
    write_marker,
)
from elastic_ft.spot.policy import leaving_nodes
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


def _agent(monkeypatch):
    """Build what an agent builds at start: its leave file, handed to the workers through the environment."""
    from types import SimpleNamespace

    from elastic_ft.rendezvous.spot_leave import hand_leave_file

    monkeypatch.delenv(LEAVE_FILE_ENV, raising=False)
    agent = SimpleNamespace(leave_file=None, _leave_if_told=lambda where: None)
    hand_leave_file(agent, "run.1")
    assert os.environ[LEAVE_FILE_ENV] == agent.leave_file  # what torchrun's workers inherit
    return agent.leave_file


def test_each_agent_gets_a_private_directory_of_its_own_for_its_marker(monkeypatch):
    first, second = _agent(monkeypatch), _agent(monkeypatch)
    assert os.path.dirname(first) != os.path.dirname(second)
    for path in (first, second):
        st = os.lstat(os.path.dirname(path))
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
        # Not the shared, predictable directory another local user could have made first.
        assert os.path.dirname(path) != os.path.join(tempfile.gettempdir(), "elastic_ft-leave")


def test_a_marker_planted_where_the_old_agents_looked_makes_no_agent_leave(monkeypatch):
    shared = os.path.join(tempfile.gettempdir(), "elastic_ft-leave")
    made = not os.path.isdir(shared)
    os.makedirs(shared, exist_ok=True)
    path = _agent(monkeypatch)
    planted = os.path.join(shared, os.path.basename(path))
    try:
        with open(planted, "w") as f:
            f.write('{"kind": "terminate", "step": 1}')
        assert read_marker(path) is None
    finally:
        os.remove(planted)
        if made:
            with contextlib.suppress(OSError):  # another process of this user may use it meanwhile
                os.rmdir(shared)


def test_writing_the_marker_follows_no_symlink(tmp_path):
    path = marker_path("r", root=str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # Where the old writer put its temp file (a predictable name), and the marker itself.
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    os.symlink(victim, path)
    write_marker(path, LeaveMarker(kind="terminate", step=3))
    assert victim.read_text() == "precious"
    assert not os.path.islink(path) and read_marker(path) == LeaveMarker(kind="terminate", step=3)


def test_a_symlinked_marker_is_not_read(tmp_path):
    path = marker_path("r", root=str(tmp_path))
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"kind": "terminate", "step": 1}')
    os.symlink(elsewhere, path)
    assert read_marker(path) is None


def test_a_worker_refuses_a_marker_path_outside_a_private_directory(tmp_path):
    path = marker_path("run.1", root=str(tmp_path))
    worker = {LEAVE_FILE_ENV: path, "TORCHELASTIC_RUN_ID": "run.1"}
    assert marker_for_worker(worker, os.getpid()) == path
    os.chmod(os.path.dirname(path), 0o755)  # others may enter: planted files possible
    assert marker_for_worker(worker, os.getpid()) is None
