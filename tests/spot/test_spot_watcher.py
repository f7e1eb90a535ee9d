"""The watcher thread and the SIGTERM handler, against a real local IMDS; the notice board's rules."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from elastic_ft.spot import watcher as watcher_mod
from elastic_ft.spot.imds import REBALANCE_PATH, ImdsClient, parse_time
from elastic_ft.spot.watcher import (
    LEVEL_LEAVE, LEVEL_NONE, LEVEL_REBALANCE, Notice, NoticeBoard, Watcher, install_sigterm,
)
from tests.ports import free_port
from tests.waiting import wait_until

WHEN = "2026-12-01T04:10:00Z"
WAIT_S = 30.0  # generous: CI's cores are loaded
SOON = dict(timeout=WAIT_S, interval=0.02)  # how the watcher tests wait


def make(url: str, interval_s: float = 60.0) -> tuple[NoticeBoard, Watcher]:
    board = NoticeBoard()
    return board, Watcher(board, ImdsClient(url, timeout_s=0.5), interval_s=interval_s, wall=lambda: 5000.0)


def test_polls_post_nothing_until_a_notice_is_served(imds):
    board, w = make(imds.url)
    assert w.poll_once() and board.level == LEVEL_NONE and board.current() == []
    imds.set_rebalance({"noticeTime": WHEN})
    assert w.poll_once() and board.level == LEVEL_REBALANCE
    imds.set_instance_action({"action": "terminate", "time": WHEN})
    assert w.poll_once() and board.level == LEVEL_LEAVE
    leave, rebalance = board.current()
    assert (leave.kind, leave.deadline, leave.seen_at) == ("terminate", parse_time(WHEN), 5000.0)
    assert rebalance.kind == "rebalance" and rebalance.deadline is None
    imds.set_instance_action(None)
    w.poll_once()
    assert board.level == LEVEL_LEAVE, "a leave notice must stay: the node is going whatever IMDS says later"


def test_the_thread_sees_a_notice_switched_on_at_runtime(imds):
    board, w = make(imds.url, interval_s=0.1)
    w.start()
    try:
        wait_until(lambda: imds.counts()[1] >= 4, what="two polls of the running watcher", **SOON)
        assert board.level == LEVEL_NONE
        imds.set_instance_action({"action": "hibernate", "time": WHEN})
        wait_until(lambda: board.level == LEVEL_LEAVE, what="the notice on the board", **SOON)
        assert board.current()[0].kind == "hibernate"
    finally:
        w.stop()
    assert not w.alive


def test_no_service_logs_one_line_and_polls_on_quietly(caplog):
    caplog.set_level(logging.INFO, logger=watcher_mod.__name__)
    board, w = make(f"http://127.0.0.1:{free_port()}", interval_s=0.05)
    w.start()
    try:
        wait_until(lambda: w.quiet, what="the probes to find no service", **SOON)
        assert w.alive and board.level == LEVEL_NONE, "the watcher must poll on (slowly), not end"
    finally:
        w.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == watcher_mod.__name__]
    assert len(lines) == 1 and "not on EC2?" in lines[0] and f"({watcher_mod.PROBE_ATTEMPTS} attempts)" in lines[0]


def test_a_rank_that_does_not_speak_for_its_node_logs_at_debug_only(caplog):
    caplog.set_level(logging.INFO, logger=watcher_mod.__name__)
    board = NoticeBoard()
    w = Watcher(board, ImdsClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5), interval_s=0.05, speaks=False)
    w.start()
    try:
        wait_until(lambda: w.quiet, what="the probes to find no service", **SOON)
    finally:
        w.stop()
    assert [r.getMessage() for r in caplog.records if r.name == watcher_mod.__name__] == []


def test_a_service_that_answers_only_after_the_probes_failed_is_still_heard(imds, caplog):
    caplog.set_level(logging.INFO, logger=watcher_mod.__name__)
    imds.fail_status = 503  # a slow start: the first probes fail
    board = NoticeBoard()
    w = Watcher(board, ImdsClient(imds.url, timeout_s=0.5), interval_s=0.05, quiet_interval_s=0.1)
    w.start()
    try:
        wait_until(lambda: w.quiet, what="the probes to fail", **SOON)
        imds.fail_status = None
        imds.set_instance_action({"action": "terminate", "time": WHEN})
        wait_until(lambda: board.level == LEVEL_LEAVE, what="the notice served after the probes failed", **SOON)
        wait_until(lambda: not w.quiet, what="the watcher to poll at its normal interval again", **SOON)
    finally:
        w.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == watcher_mod.__name__]
    assert len(lines) == 2 and "not on EC2?" in lines[0] and "terminate notice" in lines[1], lines


def test_a_failing_rebalance_document_does_not_hide_a_terminate_notice(imds):
    board, w = make(imds.url)
    imds.set_instance_action({"action": "terminate", "time": WHEN})
    imds.fail_paths[REBALANCE_PATH] = 500
    assert not w.poll_once()
    assert board.level == LEVEL_LEAVE and board.current()[0].kind == "terminate"


def test_failures_after_the_service_answered_are_logged_once_and_polling_goes_on(imds, caplog):
    caplog.set_level(logging.INFO, logger=watcher_mod.__name__)
    board, w = make(imds.url)
    assert w.poll_once()
    imds.fail_status = 500
    for _ in range(watcher_mod.PROBE_ATTEMPTS + 2):
        assert not w.poll_once() and not w.quiet, "a failure after the service answered is transient"
    imds.fail_status = None
    imds.set_instance_action({"action": "terminate", "time": WHEN})
    assert w.poll_once() and board.level == LEVEL_LEAVE
    lines = [r.getMessage() for r in caplog.records if r.name == watcher_mod.__name__]
    assert len(lines) == 3
    assert "polling IMDS failed" in lines[0] and "terminate notice" in lines[1] and "answers again" in lines[2]


def test_a_malformed_notice_is_a_terminate_logged_once(imds, caplog):
    caplog.set_level(logging.INFO, logger=watcher_mod.__name__)
    board, w = make(imds.url)
    imds.set_instance_action('{"action": "terminate", "time": "soon"}')
    for _ in range(3):
        w.poll_once()
    (notice,) = board.current()
    assert (notice.kind, notice.deadline) == ("terminate", None) and "bad time" in notice.problem
    lines = [r.getMessage() for r in caplog.records if r.name == watcher_mod.__name__]
    assert len(lines) == 1 and "time left unknown" in lines[0] and "bad time" in lines[0]


def test_sigterm_posts_a_notice_due_after_the_grace_period():
    board = NoticeBoard()
    before = signal.getsignal(signal.SIGTERM)
    handler = install_sigterm(board, grace_s=30.0, boundary_s=600.0, wall=lambda: 100.0)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        # Signal handlers run between bytecodes: the notice is posted soon, not at once.
        wait_until(lambda: board.level == LEVEL_LEAVE, what="the SIGTERM notice", **SOON)
        (notice,) = board.current()
        assert (notice.kind, notice.deadline, notice.seen_at) == ("sigterm", 130.0, 100.0)
    finally:
        handler.restore()
    assert signal.getsignal(signal.SIGTERM) is before


STUCK_WORKER = """
import os, signal, sys, time
from elastic_ft.spot.watcher import NoticeBoard, install_sigterm
from tests.waiting import wait_until
board = NoticeBoard()
handler = install_sigterm(board, grace_s=30.0, boundary_s=float(sys.argv[2]))
os.kill(os.getpid(), signal.SIGTERM)
wait_until(lambda: board.level, timeout=30, what="the SIGTERM notice", interval=0.01)  # handlers run between bytecodes
if sys.argv[1] == "answer":
    handler.answering()  # the loop reached a boundary: it commits, however long that takes
if sys.argv[1] == "steps":  # steps longer than boundary_s, each ending at a boundary that is not leaving
    for _ in range(4):
        handler.boundary(2.5)  # the last step took 2.5 s: the give-up waits 5 s from here
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            time.sleep(0.05)
    sys.exit(3)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:  # a step that does not end: a collective stuck on a lost peer
    time.sleep(0.05)
sys.exit(3)
"""


# stuck: no boundary, the fallback ends it long before the script's 60 s; answer: the boundary was
# reached well inside its 2 s, and the script outlives the 2 s by a second without being cut off; steps: four
# 1.5 s steps (each longer than boundary_s=1) pass boundaries, and none is cut off.
@pytest.mark.parametrize("mode, boundary_s, runs_s, code", [
    ("stuck", "0.5", "60", watcher_mod.SIGTERM_EXIT_CODE), ("answer", "2", "3", 3), ("steps", "1", "0", 3)])
@pytest.mark.subprocess
def test_a_worker_that_reaches_no_boundary_after_sigterm_still_exits(mode, boundary_s, runs_s, code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", STUCK_WORKER, mode, boundary_s, runs_s], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == code, proc.stderr
    assert ("no step boundary within 0.5 s" in proc.stderr) == (mode == "stuck"), proc.stderr


LOST_PEER_WORKER = """
import os, signal, sys, time
from elastic_ft.spot.watcher import NoticeBoard, install_sigterm
handler = install_sigterm(NoticeBoard(), grace_s=30.0, boundary_s=600.0, peer_lost=lambda: sys.argv[1] == "lost")
os.kill(os.getpid(), signal.SIGTERM)
handler.received.wait(30)
deadline = time.monotonic() + 2  # a step that does not end: a collective stuck on the lost peer
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(3)
"""


# With the agent's note of a lost peer, SIGTERM ends the worker at once (no 600 s wait for a boundary); without
# it the worker waits for a boundary as before (the script ends by itself after 2 s).
@pytest.mark.parametrize("lost, code", [("lost", watcher_mod.SIGTERM_EXIT_CODE), ("none", 3)])
@pytest.mark.subprocess
def test_sigterm_after_the_agent_noted_a_lost_peer_exits_without_waiting_for_a_boundary(lost, code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", LOST_PEER_WORKER, lost], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == code, proc.stderr
    assert ("without a lost peer" in proc.stderr) == (lost == "lost"), proc.stderr


def test_the_give_up_waits_for_two_steps_when_a_step_is_longer_than_the_boundary_setting():
    assert watcher_mod.give_up_after_s(10.0, None) == 10.0
    assert watcher_mod.give_up_after_s(10.0, 3.0) == 10.0
    assert watcher_mod.give_up_after_s(10.0, 20.0) == 40.0


def n(kind: str, deadline: float | None, key: str | None = None) -> Notice:
    return Notice(kind, deadline, 0.0, key or f"{kind}@{deadline}")


def test_board_keeps_the_earliest_leave_notice_and_the_newest_rebalance():
    board = NoticeBoard()
    assert board.post(n("terminate", None))
    assert board.post(n("sigterm", 50.0)), "a known deadline replaces an unknown one"
    assert not board.post(n("terminate", 60.0)), "a later deadline must not replace an earlier one"
    assert board.post(n("stop", 40.0))
    assert not board.post(n("stop", 40.0)), "the same notice polled again is not new"
    assert board.post(n("rebalance", None, "rebalance@1")) and not board.post(n("rebalance", None, "rebalance@1"))
    assert board.post(n("rebalance", None, "rebalance@2"))
    assert [(x.kind, x.key) for x in board.current()] == [("stop", "stop@40.0"), ("rebalance", "rebalance@2")]
    assert board.level == LEVEL_LEAVE


@pytest.mark.parametrize("kind, level", [("terminate", 2), ("stop", 2), ("hibernate", 2), ("sigterm", 2),
                                         ("rebalance", 1)])
def test_notice_levels(kind, level):
    assert n(kind, None).level == level
