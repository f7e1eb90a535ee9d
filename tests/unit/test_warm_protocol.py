"""The warm-start protocol's pure parts: who may be served by a warm process, where, and the messages."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from elastic_ft.warm import protocol

BASE = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "OMP_NUM_THREADS": "1", "HOME": "/root"}


def test_what_torchrun_sets_per_worker_does_not_change_the_fingerprint():
    a = {**BASE, "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
         "TORCHELASTIC_ERROR_FILE": "/tmp/a/error.json", "CUDA_VISIBLE_DEVICES": "0", "WORLD_SIZE": "2"}
    b = {**BASE, "RANK": "5", "LOCAL_RANK": "1", "MASTER_PORT": "41234", "TORCHELASTIC_RESTART_COUNT": "3",
         "TORCHELASTIC_ERROR_FILE": "/tmp/b/error.json", "CUDA_VISIBLE_DEVICES": "1", "WORLD_SIZE": "7"}
    assert protocol.fingerprint("m", "m:f", a) == protocol.fingerprint("m", "m:f", b)


def test_the_lost_node_note_of_a_round_does_not_change_the_fingerprint():
    """The agent notes a lost node in its own environment before the round's workers start: the restart after
    a node loss must fork from the agent's warm process, not start (and keep) another one."""
    lost = {**BASE, "ELASTIC_FT_LOST_NODES": "node(s) host_7090_0 (keep-alive expired) of round 2 lost"}
    assert protocol.fingerprint("m", "m:f", lost) == protocol.fingerprint("m", "m:f", BASE)


@pytest.mark.parametrize("change", [{"OMP_NUM_THREADS": "4"}, {"PYTHONPATH": "/other"}, {"NEW": "1"}])
def test_any_other_difference_does(change):
    assert protocol.fingerprint("m", "m:f", BASE) != protocol.fingerprint("m", "m:f", {**BASE, **change})


def test_so_do_the_module_and_the_preload():
    print_ = protocol.fingerprint("m", "m:f:plain", BASE)
    assert print_ != protocol.fingerprint("m", "m:f:4bit", BASE)
    assert print_ != protocol.fingerprint("n", "m:f:plain", BASE)


def test_a_socket_path_too_long_for_unix_sockets_is_none():
    assert protocol.socket_path("/tmp/d", 12, 345, "ab" * 32).endswith("/12-345-" + ("ab" * 10) + ".sock")
    assert protocol.socket_path("/tmp/" + "d" * 90, 12, 345, "ab" * 32) is None


def test_a_message_and_the_descriptors_with_it_arrive_whole():
    left, right = socket.socketpair()
    r, w = os.pipe()
    try:
        doc = {"env": {"K": "v" * 100_000}, "argv": ["a", "b"]}  # longer than one recv
        protocol.send(left, doc, fds=[r, w, w])
        got, fds = protocol.receive(right, max_fds=3)
        assert got == doc and len(fds) == 3
        os.write(fds[1], b"x")  # the passed descriptor is the pipe's write end
        assert os.read(r, 1) == b"x"
        for fd in fds:
            os.close(fd)
    finally:
        for fd in (r, w):
            os.close(fd)
        left.close()
        right.close()


def test_a_peer_that_closes_is_none_and_one_that_announces_too_much_is_refused():
    left, right = socket.socketpair()
    left.close()
    assert protocol.receive(right) == (None, [])
    right.close()
    left, right = socket.socketpair()
    left.sendall(struct.pack(">I", protocol.MAX_MESSAGE + 1))
    with pytest.raises(protocol.ProtocolError, match="over"):
        protocol.receive(right)
    left.sendall(struct.pack(">I", 3) + b"[1]")
    with pytest.raises(protocol.ProtocolError, match="not a JSON object"):
        protocol.receive(right)
    left.close()
    right.close()


def test_a_message_over_the_bound_is_not_sent():
    left, right = socket.socketpair()
    with pytest.raises(protocol.ProtocolError):
        protocol.send(left, {"x": "y" * protocol.MAX_MESSAGE})
    left.close()
    right.close()


def test_the_private_directory_is_made_0700_and_refused_when_open_to_others_or_a_symlink(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = protocol.private_dir()
    assert made == str(tmp_path / f"elastic_ft-warm-{os.getuid()}")
    assert os.stat(made).st_mode & 0o777 == 0o700
    os.chmod(made, 0o755)
    assert protocol.private_dir() is None
    os.rmdir(made)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", made)
    assert protocol.private_dir() is None


def test_only_torchruns_workers_on_linux_not_switched_off_are_enabled():
    under_torchrun = {"TORCHELASTIC_RUN_ID": "r"}
    assert protocol.enabled(under_torchrun) == os.uname().sysname.lower().startswith("linux")
    assert not protocol.enabled({**under_torchrun, protocol.SWITCH_ENV: "0"})
    assert not protocol.enabled({})  # a worker started by a shell or a test runner: no agent to live with
