"""The background saver under failures, with the real writer and a real LocalStore:
callbacks that raise, saves that keep failing, a store that hangs, a snapshot
holding NaN. The store faults are small LocalStore subclasses (the injectors)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from elastic_ft.checkpoint.reader import list_manifests, load_newest, read_manifest
from elastic_ft.checkpoint.saver import ABANDON_WAIT_S, AsyncSaver
from elastic_ft.checkpoint.save_errors import NonFiniteCheckpoint, SaveFailed, SavesFailing, SaveTimeout, nonfinite_tensors
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.store import StoreUnavailable
from elastic_ft.checkpoint.writer import CheckpointWriter, new_nonce, snapshot

RUN = "saver"


def make_snap(step: int, *, poison: str | None = None):
    """A small checkpoint-shaped snapshot; ``poison`` names a tensor to hold a NaN."""
    tensors = {"model": {"w": torch.full((256,), float(step)), "b": torch.arange(8, dtype=torch.float32)},
               "optimizer": {"w::exp_avg": torch.full((256,), 0.5), "w::step": torch.tensor(step)}}
    if poison:
        group, name = poison.split("/")
        tensors[group][name] = tensors[group][name].clone()
        tensors[group][name][3] = float("nan")
    return snapshot(step, step * 4, tensors, documents={"trainer": {"step": step}}, config_hash="cfg")


def committed_steps(store: LocalStore) -> list[int]:
    return [read_manifest(store, m.key, run_id=RUN).step for m in list_manifests(store)]


class FlakyStore(LocalStore):
    """Blob puts raise StoreUnavailable while ``failing`` (as S3 does when its retries run out)."""

    failing = False

    def put(self, key, data, *, if_absent=False):
        if self.failing and key.startswith("blobs/"):
            raise StoreUnavailable(f"{self.join(key)}: 503 SlowDown after 4 attempts")
        super().put(key, data, if_absent=if_absent)


class StuckStore(LocalStore):
    """Blob puts block until ``release`` is set (a hung connection)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release, self.entered = threading.Event(), threading.Event()

    def put(self, key, data, *, if_absent=False):
        if key.startswith("blobs/"):
            self.entered.set()
            self.release.wait(30)
        super().put(key, data, if_absent=if_absent)


@pytest.fixture
def escaped(monkeypatch) -> list:
    """Exceptions that escaped any thread (the saver's must never)."""
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def test_on_commit_raising_keeps_the_thread_and_the_commit(tmp_path, escaped, caplog):
    store = LocalStore(str(tmp_path / RUN))
    calls = []

    def on_commit(manifest, snap):
        calls.append(snap.step)
        if snap.step == 1:
            raise OSError(28, "No space left on device", "events.jsonl")

    saver = AsyncSaver(CheckpointWriter(store, RUN), on_commit=on_commit)
    saver.save(make_snap(1), new_nonce())  # the manifest landed: not a failed save
    assert committed_steps(store) == [1]
    assert saver.failed_in_row == 0
    assert saver.callback_failures == [
        "on_commit for step 1: OSError: [Errno 28] No space left on device: 'events.jsonl'"]
    assert "on_commit for step 1 raised" in caplog.text
    worker = saver._worker
    saver.save(make_snap(2), new_nonce())
    assert calls == [1, 2] and committed_steps(store) == [1, 2]
    assert saver._worker is worker and worker.is_alive(), "the saver's thread died with the callback's error"
    saver.close()
    assert escaped == []


def test_on_error_raising_keeps_the_thread(tmp_path, escaped):
    store = FlakyStore(str(tmp_path / RUN))
    store.failing = True

    def on_error(snap, exc):
        raise RuntimeError("event log closed")

    saver = AsyncSaver(CheckpointWriter(store, RUN), on_error=on_error, part_attempts=1)
    with pytest.raises(SaveFailed, match="checkpoint of step 1 not committed.*StoreUnavailable.*503 SlowDown"):
        saver.save(make_snap(1), new_nonce())
    store.failing = False
    saver.save(make_snap(2), new_nonce())
    assert committed_steps(store) == [2]
    assert saver.callback_failures == ["on_error for step 1: RuntimeError: event log closed"]
    saver.close()
    assert escaped == []


def test_consecutive_failed_saves_stop_with_the_count_and_the_last_cause(tmp_path):
    store = FlakyStore(str(tmp_path / RUN))
    errors = []
    saver = AsyncSaver(CheckpointWriter(store, RUN), on_error=lambda s, e: errors.append(s.step), part_attempts=1,
                       max_failed_saves=3)

    def submit(step):
        saver.submit(make_snap(step), new_nonce())
        saver.wait()

    submit(1)
    store.failing = True
    submit(2)
    submit(3)
    store.failing = False
    submit(4)  # a commit starts the count again
    store.failing = True
    for step in (5, 6, 7):
        submit(step)
    assert errors == [2, 3, 5, 6, 7] and saver.failed_in_row == 3
    with pytest.raises(SavesFailing, match=r"^3 checkpoint saves in a row failed \(limit 3, "
                       r"checkpoint.max_failed_saves\); the last: checkpoint of step 7 not committed "
                       r".*StoreUnavailable: .*503 SlowDown"):
        saver.submit(make_snap(8), new_nonce())
    with pytest.raises(SavesFailing, match="3 checkpoint saves in a row failed"):
        saver.flush()
    saver.close()
    assert committed_steps(store) == [1, 4]


def test_waits_are_bounded(tmp_path):
    store = StuckStore(str(tmp_path / RUN))
    saver = AsyncSaver(CheckpointWriter(store, RUN), timeout_s=0.5)
    saver.submit(make_snap(1), new_nonce())
    t0 = time.monotonic()
    with pytest.raises(SaveTimeout,
                       match=r"the checkpoint of step 1 did not finish within 0.5 s \(checkpoint.save_timeout_s\)"):
        saver.flush()
    with pytest.raises(SaveTimeout):
        saver.submit(make_snap(2), new_nonce())
    saver.close()  # does not wait a second time for the stuck save
    # Two 0.5 s waits, not one until the store gives in by itself (30 s): the
    # bound sits between the two, with room for a busy machine, not a timing goal.
    assert time.monotonic() - t0 < 20
    store.release.set()  # the store recovers: the save in flight completes, and the saver is usable again
    saver.flush()
    assert committed_steps(store) == [1]
    saver.save(make_snap(2), new_nonce())
    saver.close()
    assert committed_steps(store) == [1, 2]


def test_close_on_an_error_path_gives_the_save_up_in_seconds(tmp_path, escaped):
    """abandon: a save retrying a store outage stops at once (its backoff cut short); one stuck in an upload
    is left behind, and commits nothing once it gets through. Without abandon, close waits for the save."""
    store = FlakyStore(str(tmp_path / RUN))
    store.failing = True
    errors = []
    saver = AsyncSaver(CheckpointWriter(store, RUN), part_attempts=100, timeout_s=600,
                       on_error=lambda s, e: errors.append(s.step))
    saver.submit(make_snap(1), new_nonce())
    time.sleep(0.2)  # into the retries' backoff
    t0 = time.monotonic()
    assert saver.close(abandon=True) is True
    assert time.monotonic() - t0 < ABANDON_WAIT_S + 1  # not the ~10 min of retries left
    assert "checkpoint of step 1 not committed: abandoned, the run ends on an error" in str(saver.last_failure)
    with pytest.raises(SaveFailed, match="the checkpoint saver was closed, giving its save up: it saves no more"):
        saver.submit(make_snap(2), new_nonce())
    assert errors == [], "a callback ran after the close"

    stuck = StuckStore(str(tmp_path / "stuck"))
    saver = AsyncSaver(CheckpointWriter(stuck, RUN), timeout_s=600)
    saver.submit(make_snap(1), new_nonce())
    assert stuck.entered.wait(30)
    t0 = time.monotonic()
    assert saver.close(abandon=True) is False  # the thread is inside the store's put: left behind
    assert ABANDON_WAIT_S <= time.monotonic() - t0 < ABANDON_WAIT_S + 5
    stuck.release.set()
    saver.wait()
    assert committed_steps(stuck) == [], "a save given up was committed"
    assert escaped == []


def test_a_failed_part_logs_one_line_and_keeps_its_traceback_at_debug(tmp_path, caplog):
    store = FlakyStore(str(tmp_path / RUN))
    store.failing = True
    saver = AsyncSaver(CheckpointWriter(store, RUN), part_attempts=1)
    caplog.set_level(logging.DEBUG, logger="elastic_ft.checkpoint.saver")
    with pytest.raises(SaveFailed, match=r"part 0/1: StoreUnavailable: .*503 SlowDown"):
        saver.save(make_snap(1), new_nonce())
    saver.close()
    part = [r for r in caplog.records if "part 0/1" in r.getMessage()]
    info = [r for r in part if r.levelno == logging.INFO]
    assert len(info) == 1 and info[0].exc_info is None and "\n" not in info[0].getMessage()
    assert info[0].getMessage().startswith("checkpoint step 1 part 0/1: StoreUnavailable: ")
    debug = [r for r in part if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and debug[0].exc_info is not None
    trace = logging.Formatter().formatException(debug[0].exc_info)
    assert "Traceback" in trace and "in put" in trace and "503 SlowDown after 4 attempts" in trace, trace


def test_snapshot_with_nan_is_never_committed_and_stops_the_saves(tmp_path):
    store = LocalStore(str(tmp_path / RUN))
    errors = []
    saver = AsyncSaver(CheckpointWriter(store, RUN), on_error=lambda s, e: errors.append(e))
    saver.save(make_snap(1), new_nonce())
    saver.submit(make_snap(2, poison="optimizer/w::exp_avg"), new_nonce())
    with pytest.raises(SavesFailing, match=r"checkpoint of step 2 refused: .* non-finite values \(NaN or inf\) in "
                                           r"optimizer/w::exp_avg"):
        saver.flush()
    assert isinstance(errors[0], NonFiniteCheckpoint)
    with pytest.raises(SavesFailing, match="checkpoint of step 2 refused"):
        saver.submit(make_snap(3), new_nonce())  # training cannot repair the state: no later save either
    saver.close()
    assert committed_steps(store) == [1]
    assert store.list("blobs/000000000002-") == [], "a refused snapshot's blobs were uploaded"
    loaded, _ = load_newest(store, RUN)
    assert loaded.manifest.step == 1


def test_nonfinite_tensors_names_only_floating_tensors_with_nan_or_inf():
    tensors = {"model": {"a": torch.tensor([1.0, float("inf")]), "b": torch.ones(3, dtype=torch.bfloat16),
                         "c": torch.tensor([float("nan")], dtype=torch.float16)},
               "optimizer": {"a::step": torch.tensor(7)}}
    assert nonfinite_tensors(tensors) == ["model/a", "model/c"]


def test_saver_settings_are_checked(tmp_path):
    writer = CheckpointWriter(LocalStore(str(tmp_path)), RUN)
    with pytest.raises(ValueError, match=r"max_failed_saves \(0\)"):
        AsyncSaver(writer, max_failed_saves=0)
    with pytest.raises(ValueError, match=r"timeout_s \(nan\)"):
        AsyncSaver(writer, timeout_s=float("nan"))
