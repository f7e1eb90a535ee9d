"""A worker ends with ``os._exit`` once its output is flushed, whatever its status: never through the
interpreter's finalization, in which a gloo thread still dropping a collective's work (they outlive
``destroy_process_group`` while a module still holds the group) is ended inside a C++ destructor and
the process aborts ("terminate called without an active exception", 134). Finalization also costs
about 1.3 s with torch, transformers and peft loaded, which every node of the job waits for after a notice."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.subprocess  # each test runs a worker's exit in a child

# The interpreter's last garbage collection runs once it is finalizing: a callback that sees it says so.
FINALIZING = """
import gc, sys
def final(phase, info, is_finalizing=sys.is_finalizing, write=sys.stdout.write, flush=sys.stdout.flush):
    if phase == "start" and is_finalizing():
        write(" finalized"); flush()
        gc.callbacks.remove(final)
gc.callbacks.append(final)
"""

CHILD = FINALIZING + """
import atexit
atexit.register(lambda: print(" teardown ran", flush=True))
print("last words", end="")  # block-buffered into the pipe: only a flush gets it out
from elastic_ft.worker import finish
finish(int(sys.argv[1]))
"""

# As the worker ends a run: a gloo group its modules still hold, left with close_world, then finish.
GLOO_CHILD = FINALIZING + """
import datetime, os, tempfile
import torch, torch.distributed as dist
from elastic_ft.train.world import World, close_world
from elastic_ft.worker import finish
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
held = dist.group.WORLD  # as DDP, FSDP's mesh or a DTensor holds it: gloo's threads outlive the destroy
dist.all_reduce(torch.ones(4))
close_world(World(0, 1, 0, 1, torch.device("cpu")))
print("last words", end="")
finish(0)
"""


def run_child(script: str, code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, str(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("code", [0, 1, 2, 75])
def test_a_worker_exits_flushed_without_the_interpreters_finalization(code):
    done = run_child(CHILD, code)
    assert done.returncode == code, done.stderr
    assert done.stdout == "last words"  # flushed; no atexit hook ran, and no finalization


def test_a_worker_that_left_its_gloo_group_exits_without_finalization():
    done = run_child(GLOO_CHILD, 0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "last words", "the interpreter finalized with gloo's threads alive"
