"""AsyncSaver across two real gloo ranks: a failure only one rank sees is raised
on both alike (else one rank would stop while the other waits in a collective), and a peer lost
mid-save does not hold the survivor's close."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic_ft.checkpoint.manifest import step_of_key
from elastic_ft.checkpoint.reader import list_manifests
from elastic_ft.checkpoint.local import LocalStore
from tests.conftest import REPO, process_env

pytestmark = pytest.mark.torchrun  # two rank processes in one gloo group

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "saver_ranks.py")


def test_one_ranks_failure_is_every_ranks_failure(tmp_path):
    env = process_env(PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(r), "2", str(tmp_path)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1, "the ranks decided differently"
    # Another writer committed the step: no retry can help, so the saver stops at once (WriterFenced), on every rank.
    assert r0["conflict"].startswith("SavesFailing: checkpoint of step 1 not committed: its manifest: "
                                     "CheckpointConflict")
    assert r0["flaky"].startswith("SavesFailing: 2 checkpoint saves in a row failed (limit 2, "
                                  "checkpoint.max_failed_saves); the last: checkpoint of step 2 not committed")
    assert "part 1/2: StoreUnavailable" in r0["flaky"] and "connection reset (this rank only)" in r0["flaky"]
    assert r0["nan"].startswith("SavesFailing: checkpoint of step 1 refused") and "part 1/2: non-finite" in r0["nan"]
    assert "part 0/2" not in r0["nan"]
    assert r0["nan_next"].startswith("SavesFailing: checkpoint of step 1 refused")
    assert r0["check"].startswith("SaveFailed: checkpoint of step 1 not committed")
    assert "part 1/2: MemoryError: no memory for the check" in r0["check"]
    assert r0["check_next"] == "ok"
    assert [step_of_key(m.key) for m in list_manifests(LocalStore(str(tmp_path / "store" / "check")))] == [2]
    assert r0["paired"] == 2
    assert list_manifests(LocalStore(str(tmp_path / "store" / "nan"))) == []
    assert list_manifests(LocalStore(str(tmp_path / "store" / "flaky"))) == []


ABANDON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "abandon_ranks.py")


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["killed", "stopped"])
def test_a_peer_lost_mid_save_closes_the_survivor_in_seconds(tmp_path, mode):
    """Closing on the error path gives the save in flight up: seconds, not save_timeout_s (600 s here), and
    no manifest. killed: the survivor's part was still retrying a store outage; stopped: its saver waited
    in the gather for a peer that will never answer (no TCP reset)."""
    env = process_env(PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, ABANDON, str(r), str(tmp_path), mode], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        out = procs[0].communicate(timeout=120)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 0, out[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["error"], "the survivor's collective with the lost peer did not fail"
    assert r0["close_s"] < 10, r0  # ABANDON_WAIT_S (2 s) at most, however long the save could have taken
    assert r0["destroy_s"] < 10, r0
    if mode == "killed":  # the retries stopped: the backoff ended and no attempt started after the close
        assert r0["thread_stopped"] and r0["saver_threads"] == [], r0
        assert 1 <= r0["failed_puts"] < 10, r0
    assert "giving up the save of step 1 in flight" in out
    assert list_manifests(LocalStore(str(tmp_path / "store"))) == []
