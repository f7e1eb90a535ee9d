"""Building and closing the trainer (elastic_ft.train.build): a build step that fails closes what the steps
before it opened (the events file and its shipper, the store, the checkpoint process group), and closing on
an error gives the save in flight up instead of waiting for it (a real one-rank gloo group, in this process)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.reader import list_manifests
from elastic_ft.checkpoint.saver import ABANDON_WAIT_S
from elastic_ft.config import load_spec
from elastic_ft.train import loop
from elastic_ft.train import model as model_mod
from elastic_ft.train.world import World
from tests.conftest import DEFAULT_SPEC

CPU = torch.device("cpu")


def _trainer_args(tmp_path, *overrides: str):
    spec = load_spec(DEFAULT_SPEC, ["steps=4", "batch.global_batch=8", "batch.micro_batch=4", *overrides])
    opts = loop.RunOptions(run_id="build", checkpoint_uri=f"file://{tmp_path}/ckpt", log_dir=str(tmp_path / "logs"))
    return spec, opts


def _open_files(under) -> list[str]:
    """Files under ``under`` this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listed (listdir's own fd)
            continue
        if target.startswith(str(under)):
            out.append(target)
    return out


@pytest.fixture
def threads():
    """Torch's thread count, restored (the trainer sets it for the ranks of a host)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def store_closes(monkeypatch) -> list[str]:
    """The roots of the LocalStores closed (the real close runs)."""
    closed: list[str] = []
    real = LocalStore.close

    def close(self):
        closed.append(self.root)
        real(self)

    monkeypatch.setattr(LocalStore, "close", close)
    return closed


@pytest.fixture
def one_rank_group(tmp_path) -> World:
    """A real gloo process group of one rank: the trainer then makes its checkpoint group too."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield World(0, 1, 0, 1, CPU)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def new_groups(monkeypatch) -> list:
    """The process groups made from here on (the real new_group runs)."""
    made = []
    real = dist.new_group

    def new_group(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(dist, "new_group", new_group)
    return made


def _gone(group) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except KeyError:  # no longer registered: destroyed
        return True
    return False


def test_a_model_that_fails_to_load_closes_the_events_and_the_store(tmp_path, monkeypatch, threads, store_closes):
    def no_model(*args, **kwargs):
        raise OSError("model.safetensors: truncated file")

    monkeypatch.setattr(model_mod, "build", no_model)
    spec, opts = _trainer_args(tmp_path)
    with pytest.raises(OSError, match="truncated file"):
        loop.Trainer(spec, opts, World(0, 1, 0, 1, CPU))
    assert os.path.exists(tmp_path / "logs" / "events.jsonl"), "the events file was never opened: no test"
    assert _open_files(tmp_path) == []
    assert store_closes == [str(tmp_path / "ckpt" / "build")]


def test_a_failure_after_the_saver_closes_its_process_group(tmp_path, monkeypatch, threads, store_closes,
                                                            one_rank_group, new_groups):
    def no_restorer(**kwargs):
        raise RuntimeError("restorer: no luck")

    monkeypatch.setattr(loop, "Restorer", no_restorer)
    spec, opts = _trainer_args(tmp_path)
    with pytest.raises(RuntimeError, match="no luck"):
        loop.Trainer(spec, opts, one_rank_group)
    # The token store's exchange group (made and destroyed by the data's build), then the checkpoint group.
    assert len(new_groups) == 2, "the checkpoint group was never made: no test"
    assert all(_gone(g) for g in new_groups), "a process group was left behind"
    assert _open_files(tmp_path) == []
    assert store_closes == [str(tmp_path / "ckpt" / "build")]
    assert dist.is_initialized(), "the trainer closed the world's group, which it did not open"


def test_closing_on_an_error_gives_a_stuck_save_up_and_closes_everything(tmp_path, monkeypatch, threads,
                                                                           store_closes, one_rank_group, new_groups):
    release, entered = threading.Event(), threading.Event()
    real_put = LocalStore.put

    def stuck_put(self, key, data, *, if_absent=False):  # a hung upload
        if key.startswith("blobs/"):
            entered.set()
            release.wait(120)
        real_put(self, key, data, if_absent=if_absent)

    monkeypatch.setattr(LocalStore, "put", stuck_put)
    sigterm = signal.getsignal(signal.SIGTERM)
    spec, opts = _trainer_args(tmp_path, "checkpoint.save_timeout_s=90", "spot.enabled=true")
    trainer = loop.Trainer(spec, opts, one_rank_group)
    try:
        assert [t.name for t in threading.enumerate() if t.name.startswith("spot-")], "no spot threads: no test"
        trainer.step_once()
        trainer.save("test")  # in the background: the saver's thread enters the stuck put
        assert entered.wait(60)
        t0 = time.monotonic()
        trainer.close(RuntimeError("a collective failed: a peer is gone"))
        took = time.monotonic() - t0
    finally:
        release.set()
    assert took < ABANDON_WAIT_S + 5, f"close took {took:.1f} s"  # not save_timeout_s (90 s)
    assert [t.name for t in threading.enumerate() if t.name == "spot-watcher"] == []
    assert signal.getsignal(signal.SIGTERM) == sigterm
    assert new_groups and all(_gone(g) for g in new_groups)
    assert store_closes == [str(tmp_path / "ckpt" / "build")]
    # Released, the saver's thread finds its save given up, and ends (this trainer's: another test's
    # stuck saver may still be alive in the same process).
    worker = trainer.saver._worker
    assert worker is not None
    worker.join(30)
    assert not worker.is_alive()
    assert _open_files(tmp_path) == []
    assert list_manifests(LocalStore(str(tmp_path / "ckpt" / "build"))) == []
