"""The node's warm process: imports the worker's libraries once, then forks a ready worker per request.

``python -m elastic_ft.warm.server ...``, started by the first launcher of a
torchrun agent that finds none (:mod:`elastic_ft.warm.client`), in a session
of its own. It runs the preload (the worker's imports), listens on its socket
(see :mod:`elastic_ft.warm.protocol`), and serves until its agent exits; then
it SIGKILLs every worker it forked that is still there (a stopped one too: no
worker outlives its node's agent) and leaves.

Each request is a launcher's environment, directory, arguments and standard
streams: the fork takes them over, starts a session of its own (the launcher
forwards torchrun's signals to that group), and runs the worker module as
``python -m`` would. Its status goes back to the launcher when it ends. The
fork also watches its launcher: gone (SIGKILLed, as torchrun does 30 s after a
SIGTERM, or as a lost node is), the worker kills its group at once; stopped
(a silent node), it stops itself until the launcher forwards SIGCONT.

One thread, never a torch operation: a fork of it has no lock held by a
thread that does not exist in the child. Cost: one fork per worker start
(milliseconds; pages shared copy-on-write), whatever the model and data.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import runpy
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback

from elastic_ft.handoff import launch
from elastic_ft.warm import protocol

_STOP_POLL_S = 0.5
"""How often a fork looks whether its launcher was stopped (a silent node): a stop shows within this."""

_REQUEST_TIMEOUT_S = 10.0
"""A connected launcher sends its request at once; one that does not cannot hold the warm process longer."""


class Server:
    def __init__(self, listener: socket.socket, agent_pid: int, agent_fd: int, print_: str) -> None:
        self.listener = listener
        self.agent_pid = agent_pid
        self.agent_fd = agent_fd  # a pidfd: readable once the agent exits
        self.print_ = print_
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its launcher's connection, pidfd)

    def serve(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.agent_fd, selectors.EVENT_READ, "agent")
        while True:
            for key, _ in self.sel.select():
                if key.data == "agent":
                    self.shutdown()
                    return
                if key.data == "accept":
                    self.accept()
                else:
                    self.reap(key.data)

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            conn.settimeout(_REQUEST_TIMEOUT_S)
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():  # the directory is private; a second lock on the door
                raise protocol.ProtocolError(f"peer of uid {uid}")
            doc, fds = protocol.receive(conn, max_fds=3)
            if doc is None:
                raise protocol.ProtocolError("closed before its request")
        except (OSError, protocol.ProtocolError) as exc:
            print(f"elastic_ft.warm: a request was dropped: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return
        try:
            refused = self.refusal(doc, fds)
            if refused:
                protocol.send(conn, {"refused": refused})
                conn.close()
                return
            pid = self.fork(conn, doc, fds)
            pidfd = os.pidfd_open(pid)
            self.children[pid] = (conn, pidfd)
            self.sel.register(pidfd, selectors.EVENT_READ, pid)
            protocol.send(conn, {"pid": pid})
        except OSError as exc:  # the launcher went away meanwhile; a fork it had is reaped as usual
            print(f"elastic_ft.warm: a request failed: {exc}", file=sys.stderr, flush=True)
        finally:
            for fd in fds:
                os.close(fd)

    def refusal(self, doc: dict, fds: list[int]) -> str | None:
        if doc.get("fingerprint") != self.print_:
            return "a different interpreter, path or environment than this warm process imported with"
        if len(fds) != 3:
            return f"{len(fds)} standard streams passed, 3 expected"
        fields = {"module": str, "argv": list, "env": dict, "cwd": str, "umask": int, "launcher": int}
        wrong = [k for k, t in fields.items() if not isinstance(doc.get(k), t)]
        return f"request fields missing or malformed: {wrong}" if wrong else None

    def fork(self, conn: socket.socket, doc: dict, fds: list[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        try:
            self.sel.close()
            self.listener.close()
            os.close(self.agent_fd)
            for other, pidfd in self.children.values():
                other.close()
                os.close(pidfd)
            _take_over(doc, fds, self.agent_pid)
        except BaseException:  # noqa: BLE001 - a fork that cannot become the worker must not serve as us
            traceback.print_exc()
            os._exit(70)
        # Up the warm process's own stack (its received descriptors closed on the way, as in the parent)
        # to main(), which runs the worker there: so the worker ends as a process started cold does.
        raise _Forked(conn, doc)

    def reap(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            protocol.send(conn, {"status": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # the launcher is gone: its worker killed itself on seeing that
        conn.close()

    def shutdown(self) -> None:
        """The agent is gone: so is every worker it started through us."""
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            conn, pidfd = self.children.pop(pid)
            os.waitpid(pid, 0)
            os.close(pidfd)
            conn.close()


class _Forked(Exception):  # noqa: N818 - not an error: the fork's way out of the serving loop
    def __init__(self, conn: socket.socket, doc: dict) -> None:
        super().__init__("forked")
        self.conn = conn
        self.doc = doc


def _take_over(doc: dict, fds: list[int], agent_pid: int) -> None:
    """In the fork: become the launcher's process, as far as a process can from the inside."""
    os.setsid()  # the group the launcher forwards signals to; killed whole when the launcher is lost
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.environ.clear()
    os.environ.update(doc["env"])
    os.chdir(doc["cwd"])
    os.umask(doc["umask"])
    if os.isatty(1):  # as the interpreter decides at its start: line-buffered to a terminal
        sys.stdout.reconfigure(line_buffering=True)
    # Else every fork would draw the same numbers from the state seeded once, in the warm process.
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = list(doc["argv"])
    launch.adopt(doc["launcher"], agent_pid)


def _run_worker(conn: socket.socket, doc: dict) -> int:
    """In the fork, on main()'s level: run the module as ``python -m`` does (its SystemExit and its
    exceptions end this process as they end that one)."""
    conn.settimeout(None)
    threading.Thread(target=_watch_launcher, args=(conn, doc["launcher"]), name="warm-launcher-watch",
                     daemon=True).start()
    # As under ``python -m``, the module runs as __main__ only: the copy the preload imported (it may
    # hold the preload's function) is not the one that runs.
    sys.modules.pop(doc["module"], None)
    runpy.run_module(doc["module"], run_name="__main__", alter_sys=True)
    return 0


def _watch_launcher(conn: socket.socket, launcher: int) -> None:
    """The fork's tie to the process torchrun watches: its end is this worker's, its stop this worker's."""
    while True:
        ready, _, _ = select.select([conn], [], [], _STOP_POLL_S)
        if ready:
            try:
                data = conn.recv(1)
            except OSError:
                data = b""
            if not data:
                os.killpg(0, signal.SIGKILL)
        elif protocol.process_state(launcher) in ("T", "t"):
            os.killpg(0, signal.SIGSTOP)  # resumed by the SIGCONT the launcher forwards


def _preload(spec: str) -> None:
    """``module:function[:argument]``: import the module and call the function (with the argument)."""
    module, _, rest = spec.partition(":")
    function, _, argument = rest.partition(":")
    fn = getattr(importlib.import_module(module), function)
    fn(argument) if argument else fn()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic_ft.warm.server", description=__doc__)
    p.add_argument("--socket", required=True)
    p.add_argument("--agent-pid", type=int, required=True)
    p.add_argument("--agent-ticks", type=int, required=True)
    p.add_argument("--module", required=True)
    p.add_argument("--preload", required=True)
    p.add_argument("--fingerprint", required=True)
    args = p.parse_args(argv)
    own = protocol.fingerprint(args.module, args.preload)
    if own != args.fingerprint:
        print("elastic_ft.warm: started with another interpreter, path or environment than its launcher; "
              "not serving", file=sys.stderr)
        return 3
    try:
        agent_fd = os.pidfd_open(args.agent_pid)
    except OSError:
        return 4  # the agent is already gone
    if launch.start_ticks(args.agent_pid) != args.agent_ticks:
        return 4  # its pid names another process now
    _preload(args.preload)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(args.socket)  # a dead warm process's; the launcher holds the lock while it starts us
    except FileNotFoundError:
        pass
    listener.bind(args.socket)
    listener.listen(64)
    forked = None
    try:
        Server(listener, args.agent_pid, agent_fd, own).serve()
    except _Forked as exc:
        forked = exc
    finally:
        if forked is None:  # the warm process's own end, not a fork's
            _remove_files(args.socket)
    return 0 if forked is None else _run_worker(forked.conn, forked.doc)


def _remove_files(socket_path: str) -> None:
    """The agent is gone, and no launcher of it will come: its socket and lock go, and its log unless it says
    something (one agent's files per node start would pile up in the directory otherwise)."""
    stem = socket_path[:-len(".sock")]
    for path in (socket_path, stem + ".lock", stem + ".failed") + ((stem + ".log",) if _empty(stem + ".log") else ()):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _empty(path: str) -> bool:
    try:
        return os.path.getsize(path) == 0
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
