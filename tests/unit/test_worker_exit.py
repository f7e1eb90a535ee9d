"""A worker that committed and leaves on a notice (75) ends at once, without the interpreter's teardown
(about 1.3 s with torch, transformers and peft loaded, which every node of the job waits for); any other
status ends the normal way. Its output is flushed either way."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.subprocess  # each test runs a worker's exit in a child

CHILD = """
import atexit, sys
atexit.register(lambda: print("teardown ran", flush=True))
print("last words", end="")  # block-buffered into the pipe: only a flush gets it out
from elastic_ft.worker import finish
finish(int(sys.argv[1]))
"""


def run_child(code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_a_worker_that_left_on_a_notice_exits_without_the_teardown():
    done = run_child(75)
    assert done.returncode == 75, done.stderr
    assert done.stdout == "last words"  # flushed, and no atexit hook (the teardown's first act) ran


@pytest.mark.parametrize("code", [0, 1, 2])
def test_other_exits_keep_the_normal_teardown(code):
    done = run_child(code)
    assert done.returncode == code, done.stderr
    assert done.stdout == "last wordsteardown ran\n"
