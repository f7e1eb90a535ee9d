"""What a launcher and the node's warm process share: where the warm process listens, who may use it, the messages.

The standard library and one constant of :mod:`elastic_ft.handoff`: the
launcher imports this at every worker start, and its whole point is to import
nothing heavy.

**Where.** One warm process per torchrun agent and per *fingerprint*, listening
on a Unix socket in a private directory of this user (mode 0700, owned by us,
not a symlink: another local user can neither connect nor plant a socket
there). The socket's name holds the agent's pid and start time (a reused pid
never finds a dead agent's process) and the fingerprint.

**Who.** A fork carries everything its parent imported, so it may only serve a
worker that would have imported the same: the same interpreter and flags,
``sys.path``, module, preload and environment, except the variables torchrun
sets per worker and per restart (ranks, world sizes, master address, restart
count, visible devices) and the lost-node note our agent sets for a round
(:data:`PER_WORKER_ENV`). Any other difference gives a different fingerprint,
so a different warm process (or a cold start), never a fork with the wrong
imports.

**Messages.** A 4-byte big-endian length and a JSON document, at most
:data:`MAX_MESSAGE` bytes. The request carries the launcher's standard streams
as file descriptors (``SCM_RIGHTS``); the answers are ``{"pid": N}`` once
forked (or ``{"refused": why}``), then ``{"status": S}`` when the worker ended
(a ``waitpid`` exit code: negative for a signal).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
import sys
import tempfile

from elastic_ft.handoff.lost_nodes import LOST_NODES_ENV

SWITCH_ENV = "ELASTIC_FT_WARM_START"
"""``0`` starts every worker cold (as torchrun alone would)."""

PER_WORKER_ENV = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", LOST_NODES_ENV,
})
"""What torchrun's agent sets for each worker it starts (torch's ``LocalElasticAgent._start_workers``),
every ``TORCHELASTIC_*`` variable, and what our etcd3 handler sets in the agent's own environment for the
round after a lost node (:data:`~elastic_ft.handoff.lost_nodes.LOST_NODES_ENV`): none of them is read while
the libraries are imported (CUDA reads its devices when first used, which the warm process never does), so
they may differ between the warm process and the worker it forks. Were the lost-node note part of the
fingerprint, every restart after a node loss (the restart warm starts are for) would start a new warm
process, importing everything again, and leave the old one running until the agent exits."""

MAX_MESSAGE = 1 << 20
"""A request is one environment and one command line: 1 MiB bounds what a peer can make us hold."""

_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A peer sent something that is not a message of this protocol."""


def enabled(environ: dict | os._Environ = os.environ) -> bool:
    """Whether warm starts may be tried here: a worker torchrun started (the warm process lives as long as
    its agent: a process started by anything else, a test runner or a shell, would keep one for its whole
    life), on Linux (pids, /proc, descriptor passing), not switched off."""
    return ("TORCHELASTIC_RUN_ID" in environ and sys.platform.startswith("linux")
            and environ.get(SWITCH_ENV, "1") != "0")


def private_dir() -> str | None:
    """This user's directory for warm processes' sockets, made 0700 if missing; None if it is not private.

    ``$XDG_RUNTIME_DIR`` (a per-user tmpfs) when set, else the temp directory.
    Refused, rather than repaired, when it is a symlink, owned by someone else,
    or open to others: someone else made it, and a socket there is theirs.
    """
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"elastic_ft-warm-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (``T``: stopped), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def fingerprint(module: str, preload: str, environ: dict | os._Environ = os.environ) -> str:
    """What a warm process must share with a worker to serve it (see the module's docstring), as a digest."""
    env = {k: v for k, v in environ.items() if k not in PER_WORKER_ENV and not k.startswith("TORCHELASTIC_")}
    doc = {
        "executable": sys.executable, "version": sys.version, "flags": list(sys.flags),
        "path": sys.path, "module": module, "preload": preload, "env": sorted(env.items()),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def socket_path(directory: str, agent_pid: int, agent_ticks: int, print_: str) -> str | None:
    """The warm process's socket for this agent and fingerprint; None if too long for a Unix socket."""
    path = os.path.join(directory, f"{agent_pid}-{agent_ticks}-{print_[:20]}.sock")
    return path if len(os.fsencode(path)) < 108 else None


def send(sock: socket.socket, doc: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
    body = json.dumps(doc).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(body)} bytes, over {MAX_MESSAGE}")
    data = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` when the peer closed first."""
    fds: list[int] = []
    if max_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
    else:
        data = sock.recv(_HEADER.size)
    if not data:
        return None, fds
    data += _exactly(sock, _HEADER.size - len(data))
    (size,) = _HEADER.unpack(data)
    if size > MAX_MESSAGE:
        raise ProtocolError(f"message of {size} bytes announced, over {MAX_MESSAGE}")
    try:
        doc = json.loads(_exactly(sock, size))
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("not a JSON object")
    return doc, fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ProtocolError(f"peer closed {left} bytes before the end of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
