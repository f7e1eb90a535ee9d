"""One live writer per run (elastic_ft.checkpoint.lease): the rule, the lease on every store, and real
``elastic-ft train`` processes on file:// and S3.

Before, a second job started on the same run id and checkpoint location trained beside the first and
stopped only after its commits had conflicted three times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_ft.checkpoint.lease import (
    DEFAULT_TTL_S, Holder, LeaseHeld, LeaseLost, LeaseState, WriterLease, decide, job_identity, lease_key,
    read_state, renewal_key,
)
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.reader import list_manifests
from tests.conftest import DEFAULT_SPEC, REPO, explain, process_env, torchrun

A = Holder(job="job:a", writer="wa", host="h1", pid=100)
B = Holder(job="job:b", writer="wb", host="h2", pid=200)


def _state(holder: Holder, renewed: float, released: bool = False) -> LeaseState:
    return LeaseState(3, holder.doc(renewed), renewed, released)


# --------------------------------------------------------------------------- the rule (pure)


def test_decide_refuses_a_live_writer_of_another_job_naming_it():
    take, why = decide(_state(A, 1000.0), B, 1010.0, 60.0, alive=lambda pid: True)
    assert not take
    assert why.startswith("another writer is running: writer 'wa' of job 'job:a' (pid 100 on host 'h1'), "
                          "lease renewed 10 s ago"), why


@pytest.mark.parametrize("current, me, now, alive, expected", [
    (None, B, 0.0, True, "no writer held the run"),
    (_state(A, 1000.0, released=True), B, 1001.0, True, "released it"),
    # an elastic restart: a new leader of the same job, perhaps on another host, takes over at once
    (_state(A, 1000.0), Holder("job:a", "wa2", "h9", 300), 1001.0, True, "the same job's previous writer"),
    (_state(A, 1000.0), B, 1061.0, True, "expired 1 s ago"),
    # a writer killed on this host: its pid is gone
    (_state(A, 1000.0), Holder("job:c", "wc", "h1", 300), 1001.0, False, "is no longer running on this host"),
])
def test_decide_takes_a_free_released_expired_or_own_lease(current, me, now, alive, expected):
    take, why = decide(current, me, now, 60.0, alive=lambda pid: alive)
    assert take and expected in why, why


def test_the_job_identity_survives_restarts_and_tells_jobs_apart():
    assert job_identity({"ELASTIC_FT_JOB_ID": "local_cwd://torchx/app-1"}, host="h") == "job:local_cwd://torchx/app-1"
    # under torchrun: its rendezvous id, on every node (a new leader elsewhere is the same job)
    env = {"TORCHELASTIC_RUN_ID": "r1"}
    assert job_identity(env, host="h", parent=7) == job_identity(env, host="g", parent=8) == "torchrun:r1"
    # torchrun's default id names no job: the agent does
    env = {"TORCHELASTIC_RUN_ID": "none"}
    assert job_identity(env, host="h", parent=7) == "torchrun:none@h:7"
    assert job_identity(env, host="h", parent=8) != job_identity(env, host="h", parent=7)
    # a plain process is its own job, even the same pid again (a second run in one process)
    assert job_identity({}, host="h", pid=5) != job_identity({}, host="h", pid=5)


# --------------------------------------------------------------------------- the lease on every store


def test_a_second_writer_is_refused_until_the_lease_expires_then_the_first_is_fenced(backend):
    store = backend.store
    now = [1000.0]
    first = WriterLease(store, "r", A, clock=lambda: now[0], alive=lambda pid: True)
    first.acquire()
    second = WriterLease(store, "r", B, clock=lambda: now[0], alive=lambda pid: True)
    with pytest.raises(LeaseHeld) as info:
        second.acquire()
    assert str(info.value).startswith(f"run 'r' at {store.uri} is refused to this writer: another writer is "
                                      f"running: writer 'wa' of job 'job:a' (pid 100 on host 'h1')")
    first.check()  # still the writer
    now[0] += 61
    assert "expired 1 s ago" in second.acquire()
    with pytest.raises(LeaseLost, match=r"^run 'r': this writer's lease \(generation 1\) was taken over by "
                                        r"writer 'wb' of job 'job:b'"):
        first.check()
    first.release()  # a fenced writer releases nothing: the lease is the new holder's
    assert read_state(store).doc["writer"] == "wb" and not read_state(store).released


def test_renewal_keeps_the_lease_and_release_frees_it(backend):
    store = backend.store
    now = [1000.0]
    first = WriterLease(store, "r", A, clock=lambda: now[0], alive=lambda pid: True)
    first.acquire()
    now[0] += 50
    first._renew()
    now[0] += 50  # 100 s after taking it, 50 after renewing: still held
    with pytest.raises(LeaseHeld):
        WriterLease(store, "r", B, clock=lambda: now[0], alive=lambda pid: True).acquire()
    first.release()
    assert "released it" in WriterLease(store, "r", B, clock=lambda: now[0], alive=lambda pid: True).acquire()


def test_of_writers_racing_for_a_free_run_exactly_one_wins(backend):
    store = backend.store
    holders = [Holder(f"job:{i}", f"w{i}", "h", 1000 + i) for i in range(6)]
    barrier = threading.Barrier(len(holders))
    outcomes: list[str] = []

    def race(h: Holder) -> None:
        barrier.wait()
        try:
            WriterLease(store, "r", h, alive=lambda pid: True).acquire()
            outcomes.append("won")
        except LeaseHeld:
            outcomes.append("refused")

    threads = [threading.Thread(target=race, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["refused"] * 5 + ["won"]
    assert [o.key for o in store.list("lease/")] == [lease_key(1), renewal_key(1)]


# --------------------------------------------------------------------------- real writers


def _train_cmd(uri: str, run_id: str, logs: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "elastic_ft.cli", "train", "--spec", DEFAULT_SPEC, "--run_id", run_id,
            "--checkpoint_uri", uri, "--log_dir", logs, *overrides]


def _wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the first writer exited ({proc.returncode}) before {what}:\n"
                                 f"{proc.stdout.read()}\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _two_writers(store, uri: str, tmp_path, env: dict) -> None:
    """The first writer trains; a second on the same run is refused naming it; a takeover fences the first."""
    first = subprocess.Popen(_train_cmd(uri, "run", str(tmp_path / "logs1"), "steps=400", "checkpoint.every_steps=5"),
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(list_manifests(store)) >= 1, "its first commit", first)
        second = subprocess.run(_train_cmd(uri, "run", str(tmp_path / "logs2"), "steps=400"), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, explain(second)
        errors = [line for line in second.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"run 'run' at {uri.rstrip('/')}/run is refused to this writer: another writer is running: " \
               f"writer '" in errors[0] and f"(pid {first.pid} on host" in errors[0], errors[0]
        assert first.poll() is None, "the first writer stopped"
        # Another writer takes the run over (as after the first's lease expired): the first stops before its
        # next commit, and commits nothing more.
        now = time.time() + DEFAULT_TTL_S + 1
        WriterLease(store, "run", B, clock=lambda: now).acquire()
        before = {o.key for o in list_manifests(store)}
        out, err = first.communicate(timeout=300)
        after = {o.key for o in list_manifests(store)}
        assert first.returncode == 2, f"{out}\n{err}"
        assert "was taken over by writer 'wb' of job 'job:b'" in err and "stops without committing" in err, err
        assert len(after - before) <= 1, "the fenced writer kept committing"  # at most a commit already past its check
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.wait()


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_train_processes_on_one_file_run(tmp_path):
    _two_writers(LocalStore(str(tmp_path / "runs" / "run")), f"file://{tmp_path}/runs", tmp_path, process_env())


@pytest.mark.torchrun
@pytest.mark.s3server
@pytest.mark.slow
def test_two_train_processes_on_one_s3_run(tmp_path, s3_servers, s3_env):
    from tests.checkpoint.s3_servers import aws_env

    from elastic_ft.checkpoint.store import open_store

    endpoint = s3_servers.get("seaweedfs")
    s3_env(endpoint)
    base = f"s3://{endpoint.bucket}/lease/{tmp_path.name}"
    store = open_store(f"{base}/run")
    try:
        _two_writers(store, base, tmp_path, aws_env(process_env(), endpoint, str(tmp_path)))
    finally:
        store.close()


@pytest.mark.torchrun
@pytest.mark.slow
def test_an_elastic_restart_takes_over_its_own_runs_lease_at_once(tmp_path):
    """The leader killed at step 3 (its lease neither released nor expired): torchrun restarts every worker,
    and the new leader (a new process) takes the lease its job held at once, and the run completes."""
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", f"file://{tmp_path}",
            "--log_dir", str(tmp_path / "logs"), "steps=6", "checkpoint.every_steps=2"]
    proc = torchrun(2, args, max_restarts=1, env=process_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                                             ELASTIC_FT_FAULTS="kill:rank=0,step=3,restart=0"))
    assert proc.returncode == 0, explain(proc)
    store = LocalStore(str(tmp_path / "run"))
    first, second = (json.loads(store.get(lease_key(g))) for g in (1, 2))
    assert first["job"] == second["job"] and first["job"].startswith("torchrun:")
    assert first["pid"] != second["pid"]  # a new leader process
    assert second["taken_because"].startswith("the same job's previous writer held it"), second
    assert json.loads(store.get(renewal_key(2)))["released"] is True  # released at its clean end
    assert not json.loads(store.get(renewal_key(1)))["released"]  # the killed attempt never released it
    assert second["acquired"] - first["acquired"] < DEFAULT_TTL_S, "the restart waited for the lease to expire"
