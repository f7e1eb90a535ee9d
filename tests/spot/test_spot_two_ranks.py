"""Two real gloo ranks where one never joins a collective: SIGTERM, mixed spot.enabled, a settle that times out.

Rank 1 is a peer that holds on (for :data:`HOLD_S`) without entering the
collective rank 0 waits in; the tests wait (up to :data:`WAIT_S`, well below
the hold) for rank 0 to exit on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic_ft.spot.watcher import SIGTERM_EXIT_CODE
from tests.ports import free_port

pytestmark = pytest.mark.torchrun  # two rank processes in one gloo group

HOLD_S = 120
WAIT_S = 60  # generous, and well below HOLD_S: CI's cores are loaded

RANK = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from elastic_ft.train.world import init_world
mode, rank = sys.argv[1], int(os.environ["RANK"])
WAIT = float(sys.argv[2])
world = init_world()
t = torch.ones(1)
dist.all_reduce(t)  # both ranks are in the group
if mode == "sigterm":
    if rank == 0:
        from elastic_ft.spot.watcher import NoticeBoard, install_sigterm
        install_sigterm(NoticeBoard(), grace_s=30.0, boundary_s=2.0)
    print("synced", flush=True)
    if rank == 0:
        dist.all_reduce(t)  # rank 1 never comes: blocked in C until SIGTERM's fallback ends the process
elif mode == "mixed":
    from elastic_ft.config.sections import SpotConfig
    from elastic_ft.runevents.events import EventLog
    from elastic_ft.spot.watcher import Notice
    from elastic_ft.train.preemption import Preemption
    cfg = SpotConfig(enabled=rank == 0, sigterm=False)
    p = Preemption(cfg, world, EventLog(None), endpoint="http://127.0.0.1:1")
    if rank == 0:
        p.board.post(Notice("terminate", None, 0.0, "t"))
    level = p.agree()
    s = torch.tensor([float(rank + 10)])
    dist.all_reduce(s)  # the next collective still pairs up
    p.close()
    print(f"level {level} sum {s.item():g}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)
elif mode == "settle":
    from elastic_ft.train.world import close_world, exit_process, settle
    if rank == 0:
        print(f"settled {settle(world, timedelta(seconds=1))}", flush=True)
        close_world(world)  # as the worker leaves: run()'s finally, then its exit
        exit_process(0)
    print("synced", flush=True)
elif mode == "settle_all":
    from elastic_ft.train.world import close_world, settle
    def collective(*args, **kwargs):
        raise AssertionError("settle() used a collective of the process group")
    dist.barrier = dist.all_reduce = collective  # on NCCL, a timed-out collective wait takes the process down
    print(f"settled {settle(world, timedelta(seconds=WAIT))} {settle(world, timedelta(seconds=WAIT))}", flush=True)
    close_world(world)
    sys.exit(0)
time.sleep(float(sys.argv[2]))  # rank 1: a peer that holds on without entering the collective
"""


def start(mode: str, port: int) -> list[subprocess.Popen]:
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, mode, str(HOLD_S)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


@pytest.fixture
def ranks():
    procs: list[subprocess.Popen] = []
    yield lambda mode: procs.extend(start(mode, free_port())) or procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_sigterm_ends_a_worker_blocked_in_a_collective_on_a_silent_peer(ranks):
    zero, one = ranks("sigterm")
    assert zero.stdout.readline() == "synced\n", zero.stderr.read()  # blocking: rank 0 goes on to wait
    assert one.stdout.readline() == "synced\n"
    zero.send_signal(signal.SIGTERM)
    try:
        code = zero.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 stayed blocked in its collective after SIGTERM")
    assert code == SIGTERM_EXIT_CODE, zero.stderr.read()
    assert "no step boundary within 2 s" in zero.stderr.read()


def test_ranks_agree_on_notices_when_only_one_has_spot_enabled(ranks):
    zero, one = ranks("mixed")
    for p in (zero, one):
        try:
            out, err = p.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail("a rank is stuck: the ranks made different collectives")
        assert p.returncode == 0, err
        assert out == "level 2 sum 21\n", err


def test_ranks_settle_on_the_store_without_a_collective(ranks):
    """settle() meets on the process group's store: no collective whose timed-out wait NCCL's watchdog
    would answer by taking the process down (see elastic_ft.train.world.settle). Twice: each call meets
    under its own key."""
    for p in ranks("settle_all"):
        try:
            out, err = p.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail("a rank waited in settle() although both came")
        assert (p.returncode, out) == (0, "settled True True\n"), err


def test_a_settle_that_times_out_does_not_hold_up_the_exit(ranks):
    zero, one = ranks("settle")
    assert one.stdout.readline() == "synced\n"
    try:
        out, err = zero.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 waited for its timed-out barrier on the way out")
    assert (zero.returncode, out) == (0, "settled False\n"), err
