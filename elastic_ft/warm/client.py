"""The launcher: the process torchrun starts per worker, which has the node's warm process fork the worker.

:func:`run` returns only when a warm start is not possible (then the caller
starts the worker cold, in this process, as before) and otherwise ends this
process with the worker's exit status: an exit code as the worker's, a signal
re-raised on itself, so torchrun sees what it would have seen of a cold worker.
Every signal torchrun (or a user) sends here goes on to the worker's process
group, SIGCONT included; SIGKILL cannot, and the worker sees this process go
and kills itself (:mod:`elastic_ft.warm.server`).

Standard library only, so this process costs tens of milliseconds to start.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

from elastic_ft.handoff import launch
from elastic_ft.warm import protocol

LAUNCH_WAIT_S = 300.0
"""How long a launcher waits for the warm process it started to import the libraries and listen (a
loaded node with several workers starting at once takes a while; a cold start would take as long)."""

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM, signal.SIGWINCH)


def run(module: str, preload: str) -> None:
    """Run ``module`` (this process's ``python -m`` module) forked from the node's warm process.

    ``preload`` (``module:function[:argument]``) is what the warm process calls
    before it serves: the imports the worker would make. Returns when a warm
    start is not possible, saying why on stderr unless it was switched off."""
    if not protocol.enabled():
        return
    why = _start(module, preload)
    print(f"elastic_ft: starting this worker cold: {why}", file=sys.stderr, flush=True)


def _start(module: str, preload: str) -> str:
    """Serve this process from the warm process (never returns then), or the reason it cannot."""
    agent = os.getppid()
    ticks = launch.start_ticks(agent)
    directory = protocol.private_dir()
    if ticks is None or directory is None:
        return "no /proc entry for the agent" if ticks is None else "no private directory for the warm process"
    print_ = protocol.fingerprint(module, preload)
    path = protocol.socket_path(directory, agent, ticks, print_)
    if path is None:
        return f"the path of its socket in {directory} is too long for a Unix socket"
    sock = _connect(path) or _launch(path, agent, ticks, module, preload, print_)
    if isinstance(sock, str):
        return sock
    umask = os.umask(0o022)
    os.umask(umask)
    pending: list[int] = []
    child: list[int] = []

    def forward(signum, _frame) -> None:
        if not child:
            pending.append(signum)  # before the fork answered: sent on as soon as it has
            return
        try:
            os.killpg(child[0], signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        protocol.send(sock, {"module": module, "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                             "umask": umask, "launcher": os.getpid(), "fingerprint": print_},
                      fds=[0, 1, 2])
        answer, _ = protocol.receive(sock)
    except (OSError, protocol.ProtocolError) as exc:
        _give_up(sock, pending)
        return f"the warm process did not answer ({exc})"
    if not answer or "pid" not in answer:
        _give_up(sock, pending)
        return f"the warm process refused: {(answer or {}).get('refused', 'it closed the connection')}"
    child.append(int(answer["pid"]))
    for signum in pending:
        forward(signum, None)
    _exit_as(_wait(sock, child[0]))


def _give_up(sock: socket.socket, pending: list[int]) -> None:
    """Before a cold start: the connection closed (a fork the warm process made anyway sees that and ends),
    the signals as they were, and those that came meanwhile delivered to this process, which runs the worker."""
    sock.close()
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for signum in pending:
        os.kill(os.getpid(), signum)


def _wait(sock: socket.socket, pid: int) -> int:
    """The worker's status (a waitpid exit code), as the warm process reports it."""
    while True:
        try:
            answer, _ = protocol.receive(sock)
        except (OSError, protocol.ProtocolError):
            answer = None
        if answer is None:
            # The warm process is gone (its agent ended, or it was killed): so is the worker, or it will be.
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            print("elastic_ft: the node's warm process ended before this worker; worker killed",
                  file=sys.stderr, flush=True)
            return -signal.SIGKILL
        if "status" in answer:
            return int(answer["status"])


def _exit_as(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be changed
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(1)  # a signal whose default is to ignore it ends nothing: fall through
        status = 128 - status
    os._exit(status)


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _launch(path: str, agent: int, ticks: int, module: str, preload: str, print_: str) -> socket.socket | str:
    """Start the warm process (one launcher per agent at a time: a lock), and connect to it; or why not."""
    lock_fd = os.open(path[:-len(".sock")] + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + LAUNCH_WAIT_S
        while True:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    return "another launcher held the warm process's start too long"
                time.sleep(0.05)
        sock = _connect(path)  # another launcher started it while this one waited
        if sock is not None:
            return sock
        failed = path[:-len(".sock")] + ".failed"
        if os.path.exists(failed):
            return f"the warm process failed to start before (see {failed[:-len('.failed')]}.log)"
        return _spawn(path, agent, ticks, module, preload, print_, failed, deadline)
    finally:
        os.close(lock_fd)


def _spawn(path: str, agent: int, ticks: int, module: str, preload: str, print_: str, failed: str,
           deadline: float) -> socket.socket | str:
    log_path = path[:-len(".sock")] + ".log"
    # The interpreter and its options as this process got them (e.g. torchrun's -u), so that its
    # fingerprint (sys.flags) is this one's.
    interpreter = sys.orig_argv[:sys.orig_argv.index("-m")] if "-m" in sys.orig_argv else [sys.executable]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*interpreter, "-m", "elastic_ft.warm.server", "--socket", path, "--agent-pid", str(agent),
             "--agent-ticks", str(ticks), "--module", module, "--preload", preload, "--fingerprint", print_],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    while time.monotonic() < deadline:
        sock = _connect(path)
        if sock is not None:
            return sock
        if proc.poll() is not None:
            with open(failed, "w") as f:
                f.write(f"exit status {proc.returncode}\n")
            return f"the warm process exited with status {proc.returncode} while starting (see {log_path})"
        time.sleep(0.05)
    proc.kill()
    return f"the warm process did not listen within {LAUNCH_WAIT_S:.0f} s (see {log_path})"
