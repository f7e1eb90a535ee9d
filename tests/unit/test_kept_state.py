"""The node-local kept state: written in the background, read back exactly, refused when torn, foreign or stale,
in a private directory."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from elastic_ft.train import kept_files
from elastic_ft.train.kept_files import KeptStateError, kept_dir, kept_name, remove_orphans
from elastic_ft.train.kept_state import Keeper, read_kept

RUN, CONFIG = "run-a", "cfg-1"


def state(seed: float) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(seed * 1000))
    return {
        "model": {"layer.lora_A.weight": torch.randn(8, 16, generator=g),
                  "layer.lora_B.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)},
        "optimizer": {"layer.lora_A.weight::exp_avg": torch.randn(8, 16, generator=g),
                      "layer.lora_A.weight::step": torch.tensor(seed)},
    }


def meta(step: int, **extra) -> dict:
    return {"run_id": RUN, "config_hash": CONFIG, "step": step, "cursor": step * 32,
            "batch_plan": {"global_batch": 32}, "documents": {"trainer": {"step": step}}, **extra}


def keep_steps(directory: str, name: str, steps: range) -> dict:
    keeper = Keeper(directory, name)
    last = None
    try:
        for step in steps:
            last = state(step)
            keeper.keep(last, meta(step))
        assert keeper.flush()
        assert keeper.failures == 0
    finally:
        keeper.close()
    return last


@pytest.fixture
def directory(tmp_path) -> str:
    return kept_dir(str(tmp_path))


def test_the_newest_step_reads_back_exactly_and_older_files_are_gone(directory):
    name = kept_name(RUN, "123.456")
    last = keep_steps(directory, name, range(1, 6))
    held, why = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
    assert held is not None, why
    assert held.step == 5 and held.meta["cursor"] == 160 and held.meta["batch_plan"] == {"global_batch": 32}
    got = held.tensors()
    assert set(got) == set(last)
    for group in last:
        assert set(got[group]) == set(last[group])
        for k, t in last[group].items():
            assert got[group][k].dtype == t.dtype and torch.equal(got[group][k], t), k
    # The sidecar and the keeper's two slots; no temp file left.
    assert sorted(os.listdir(directory)) == sorted([f"{name}.json", f"{name}-{os.getpid()}-0.safetensors",
                                                    f"{name}-{os.getpid()}-1.safetensors"])


def test_nothing_kept_is_none_with_a_reason(directory):
    assert read_kept(directory, kept_name(RUN, "1.1"), run_id=RUN, config_hash=CONFIG) == (
        None, "no state kept on this node")


def test_a_torn_or_altered_file_is_refused(directory):
    name = kept_name(RUN, "1.2")
    keep_steps(directory, name, range(1, 3))
    data = os.path.join(directory, json.loads(open(os.path.join(directory, f"{name}.json")).read())["file"])
    raw = bytearray(open(data, "rb").read())
    raw[-1] ^= 0xFF  # the same size, one byte flipped
    open(data, "wb").write(raw)
    held, why = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
    assert held is None and "does not match its sidecar's checksum" in why
    open(data, "wb").write(raw[:-10])  # torn: cut short
    held, why = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
    assert held is None and "bytes, its sidecar says" in why
    side = os.path.join(directory, f"{name}.json")
    open(side, "w").write('{"format": "elastic_ft.kept_state/1", "run_id": "run-a"')  # a torn sidecar
    held, why = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
    assert held is None and "unreadable" in why


def test_a_sidecar_naming_another_path_is_refused(directory, tmp_path):
    name = kept_name(RUN, "1.3")
    keep_steps(directory, name, range(1, 2))
    side = os.path.join(directory, f"{name}.json")
    doc = json.loads(open(side).read())
    doc["file"] = "../../etc/passwd"
    open(side, "w").write(json.dumps(doc))
    held, why = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
    assert held is None and "malformed" in why


def test_a_foreign_run_or_config_is_refused_but_reported_with_its_identity(directory):
    name = kept_name(RUN, "1.4")
    keep_steps(directory, name, range(1, 2))
    held, why = read_kept(directory, name, run_id="run-b", config_hash=CONFIG)
    assert held is None and "belongs to run 'run-a'" in why
    held, why = read_kept(directory, name, run_id=RUN, config_hash="cfg-2")
    assert held is None and "not this run's" in why
    # Read for a report (no identity asked): the identity it carries is the file's own, which the decision judges.
    held, _ = read_kept(directory, name, run_id=None, config_hash=None)
    assert held is not None and held.identity == kept_files.identity_of(RUN, CONFIG) != kept_files.identity_of(
        RUN, "cfg-2")


def test_a_gone_agents_files_are_not_found_by_another_agent_and_are_removed_whatever_their_run(directory):
    gone = kept_name(RUN, "999999999.1")  # an agent pid that does not run
    keep_steps(directory, gone, range(1, 3))
    alive = kept_name(RUN, kept_files.agent_id())
    keep_steps(directory, alive, range(1, 2))
    other_run = kept_name("run-z", "999999999.1")
    keep_steps(directory, other_run, range(1, 3))
    # Another agent (a whole-job restart on this host) looks under its own name: finds nothing.
    assert read_kept(directory, kept_name(RUN, "5.5"), run_id=RUN, config_hash=CONFIG)[0] is None
    assert remove_orphans(directory) == 6  # each gone agent's sidecar and two slots, whichever run they kept
    left = os.listdir(directory)
    assert not [f for f in left if f.startswith(gone) or f.startswith(other_run)]
    assert sorted(f for f in left if f.startswith(alive)) == sorted(
        [f"{alive}.json", f"{alive}-{os.getpid()}-0.safetensors"])


def test_discard_removes_this_nodes_files(directory):
    name = kept_name(RUN, "1.6")
    keep_steps(directory, name, range(1, 3))
    kept_files.discard(directory, name)
    assert os.listdir(directory) == []


def test_close_with_discard_after_keeping(directory):
    keeper = Keeper(directory, kept_name(RUN, "1.7"))
    keeper.keep(state(1), meta(1))
    keeper.close(discard_files=True)
    assert os.listdir(directory) == []


def test_the_directory_is_private_and_owned(tmp_path):
    path = kept_dir(str(tmp_path))
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    os.chmod(path, 0o755)
    with pytest.raises(KeptStateError, match="open to other users"):
        kept_dir(str(tmp_path))
    os.rmdir(path)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, path)
    with pytest.raises(KeptStateError, match="symlink"):
        kept_dir(str(tmp_path))


def test_a_symlinked_sidecar_is_not_followed(directory, tmp_path):
    name = kept_name(RUN, "1.8")
    keep_steps(directory, name, range(1, 2))
    side = os.path.join(directory, f"{name}.json")
    real = tmp_path / "planted.json"
    real.write_text(open(side).read())
    os.unlink(side)
    os.symlink(real, side)
    held, why = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
    assert held is None and "sidecar unusable" in why


def test_keep_does_not_wait_while_the_writer_is_idle_and_writes_each_step(directory, monkeypatch):
    """The step hands over its copy without waiting when the previous write is done, and the copy is private:
    changing the trained tensors after keep() does not change what is written."""
    name = kept_name(RUN, "1.9")
    keeper = Keeper(directory, name)
    try:
        live = state(1)
        keeper.keep(live, meta(1))
        expected = {g: {k: t.clone() for k, t in d.items()} for g, d in live.items()}
        for d in live.values():
            for t in d.values():
                t.add_(1)  # the next step's update
        assert keeper.flush()
        held, _ = read_kept(directory, name, run_id=RUN, config_hash=CONFIG)
        assert held is not None and held.step == 1
        got = held.tensors()
        assert all(torch.equal(got[g][k], t) for g, d in expected.items() for k, t in d.items())
    finally:
        keeper.close()


def keeping_peers(tmp_path, monkeypatch):
    """A one-rank PeerState that keeps steps (as under torchrun), and the events it emits."""
    from elastic_ft.train.peer_state import PeerState
    from elastic_ft.train.world import World

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")  # as under torchrun: the keeper is on
    emitted = []

    class Events:
        def emit(self, event, **fields):
            emitted.append((event, fields))

    return PeerState(World(0, 1, 0, 1, torch.device("cpu")), run_id=RUN, config_hash=CONFIG, enabled=True,
                     strategy="ddp", directory=str(tmp_path), events=Events()), emitted


def test_a_state_two_copies_of_which_do_not_fit_keeps_nothing_and_says_so(tmp_path, monkeypatch):
    peers, emitted = keeping_peers(tmp_path, monkeypatch)
    assert peers.keeper is not None
    huge = {"model": {"w": torch.empty(1, dtype=torch.uint8).expand(1 << 50)}}  # a PiB, never allocated
    peers.keep(step=1, cursor=32, tensors=huge, manifest={}, documents={})
    assert peers.keeper is None
    assert emitted and emitted[0][0] == "kept_state_off" and "exceed 50% of the free space" in emitted[0][1]["reason"]
    assert os.listdir(kept_dir(str(tmp_path))) == []


def test_a_state_that_fits_is_kept_through_peer_state_and_fsdp_or_off_keeps_nothing(tmp_path, monkeypatch):
    from elastic_ft.train.peer_state import PeerState
    from elastic_ft.train.world import World

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    world = World(0, 1, 0, 1, torch.device("cpu"))
    peers = PeerState(world, run_id=RUN, config_hash=CONFIG, enabled=True, strategy="ddp", directory=str(tmp_path))
    peers.keep(step=3, cursor=96, tensors=state(3), manifest={"batch_plan": {"global_batch": 32}}, documents={})
    peers.keeper.flush()
    held = peers.report()
    assert held is not None and held.step == 3 and held.identity == peers.identity
    peers.close(ended=True)
    assert os.listdir(kept_dir(str(tmp_path))) == []
    for kw in ({"enabled": True, "strategy": "fsdp"}, {"enabled": False, "strategy": "ddp"}):
        other = PeerState(world, run_id=RUN, config_hash=CONFIG, directory=str(tmp_path), **kw)
        assert other.keeper is None and not other.active


def test_a_state_that_cannot_be_kept_turns_keeping_off_and_training_goes_on(tmp_path, monkeypatch):
    peers, emitted = keeping_peers(tmp_path, monkeypatch)
    odd = {"model": {"w": torch.zeros(3, dtype=torch.complex64)}}  # no safetensors name here
    peers.keep(step=1, cursor=32, tensors=odd, manifest={}, documents={})  # does not raise
    assert peers.keeper is None and emitted[0][0] == "kept_state_off" and "complex64" in emitted[0][1]["reason"]
