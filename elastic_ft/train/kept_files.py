"""Where a node keeps its last completed step (:mod:`elastic_ft.train.kept_state`): the private directory, the
files' names, and who may remove them.

The directory is this user's, under ``/dev/shm`` where it exists (0700, owned by this user, a symlink
refused); every file in it is opened without following a symlink and only if it is a regular file of ours.
A file's name holds the run and the node's torchrun agent (pid and start time), so a worker restarted by the
same agent finds it and nothing else does; files of agents that are gone are removed at the next start.
Costs: one directory listing per worker start; nothing per step.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading

from elastic_ft.handoff import launch


class KeptStateError(RuntimeError):
    """The kept-state directory cannot be used safely (not ours, not private, a symlink)."""


def kept_dir(base: str | None = None) -> str:
    """The private directory of this user's kept states: under ``/dev/shm`` where it exists, else the temp dir.

    Created 0700 if absent; raises :class:`KeptStateError` when it is a symlink, not a directory, not owned by
    this user, or open to others (another user could then plant or read a state).
    """
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(base, f"elastic_ft-kept-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise KeptStateError(f"kept state directory {path} is a symlink or not a directory: remove it")
    if st.st_uid != os.getuid():
        raise KeptStateError(f"kept state directory {path} belongs to uid {st.st_uid}, not this user: remove it")
    if st.st_mode & 0o077:
        raise KeptStateError(f"kept state directory {path} is open to other users "
                             f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 700 it or remove it")
    return path


def agent_id() -> str:
    """This worker's torchrun agent, as ``<pid>.<start time>`` (the start time tells a reused pid apart).

    The agent restarts the workers of a membership change, and a new job starts a new agent; it is the
    worker's parent, or its launcher's when the node's warm process forked it (:mod:`elastic_ft.handoff.launch`).
    Without ``/proc`` (not Linux) the pid alone.
    """
    agent = launch.agent_pid()
    return f"{agent}.{launch.start_ticks(agent) or 0}"


def kept_name(run_id: str, agent: str) -> str:
    """The file name stem of ``run_id``'s state kept under ``agent`` (hashed: a run id may be long)."""
    return f"run-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}-agent-{agent}"


def identity_of(run_id: str, config_hash: str) -> int:
    """The state's identity as a non-negative int64 (what the ranks exchange): the run and its training config."""
    return int.from_bytes(hashlib.sha256(f"{run_id}\0{config_hash}".encode()).digest()[:8], "big") >> 1


def open_own(path: str, flags: int) -> int:
    """An fd of ``path`` opened without following a symlink, refused unless a regular file of this user."""
    fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise KeptStateError(f"{path} is not a regular file of this user")
    return fd


def read_all(fd: int, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    if got != size:
        raise KeptStateError(f"file ended after {got} of {size} bytes")
    return buf


def write_atomically(directory: str, final: str, data: bytes) -> None:
    """Write ``data`` to ``directory/final`` through a private temp file and a rename (never seen half-written)."""
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{threading.get_ident()}-{final}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, os.path.join(directory, final))


def discard(directory: str, name: str) -> None:
    """Remove the files kept under ``name`` (the run ended normally: nothing will resume from them)."""
    for other in os.listdir(directory):
        if other == f"{name}.json" or (other.startswith(f"{name}-") and other.endswith(".safetensors")):
            try:
                os.unlink(os.path.join(directory, other))
            except FileNotFoundError:
                pass


def remove_orphans(directory: str) -> int:
    """Remove the files of every run kept under agents that are gone (a job before this one on this host, a
    node whose agent was killed), and temp files of writers that are gone (a worker killed mid-write): a kept
    state belongs to its agent, so nothing can resume from them, and they hold shared memory. Files of live
    agents (other jobs of this user on this host included) stay. Returns how many files went."""
    removed = 0
    for other in os.listdir(directory):
        if other.startswith("run-") and "-agent-" in other:
            agent = other.split("-agent-", 1)[1].split("-", 1)[0].removesuffix(".json")
            pid, _, started = agent.partition(".")
            gone = not (pid.isdigit() and _alive(int(pid), started))
        elif other.startswith(".tmp-"):
            pid = other.split("-")[1]
            gone = pid.isdigit() and not _alive(int(pid), None)
        else:
            continue
        if gone:
            try:
                os.unlink(os.path.join(directory, other))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` runs (and started at ``started``, when given); True where that cannot be told."""
    if not os.path.isdir("/proc"):
        return True
    ticks = launch.start_ticks(pid)
    return ticks is not None and (started is None or str(ticks) == started)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
