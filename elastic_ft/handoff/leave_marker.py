"""A node's leave on a spot notice: the marker its workers write and its torchrun agent reads.

The protocol both sides share (the agent's side: :mod:`elastic_ft.rendezvous.spot_leave`;
the workers': :mod:`elastic_ft.train.preemption`).

torchrun counts any nonzero worker exit as a failure: it would restart the
workers of a node that was told to go (they see the notice still standing and
leave again, costing every node a new round each time), and exit 1 in the end.
So a worker whose node leaves writes a **marker file** before it exits, and
the etcd3 rendezvous handler (:mod:`elastic_ft.rendezvous.handler`) of the
same agent reads it: it removes the node from the rendezvous (without closing
it, so the other nodes form a smaller round at once) and ends the agent with
:data:`RECLAIM_EXIT_CODE`.

The marker's path is chosen by the agent when it builds its handler and handed
to the workers in :data:`LEAVE_FILE_ENV`: a file named for the run id and the
agent's pid in a directory of the agent's own, made by ``tempfile.mkdtemp``
(mode 0700, a fresh random name), never a rank. So a marker left by an
earlier agent (a node restarted with the same command, a crash before the
agent read it) can never make a new agent leave, and no other local user can
plant a marker, or a symlink that a write would follow, where an agent looks
(a shared, predictable ``/tmp`` directory allowed both). Every write goes
through a fresh ``mkstemp`` file renamed into place, and reads do not follow
a symlink.

The nodes that stay write a marker too, flagged :attr:`LeaveMarker.stays`:
their agent then restarts their workers in a new round as for a node that
joins (torch counts that as a change of membership, not as one of
``--max-restarts``), and tells the next round's workers which node left and
on which notice. The workers wait for that restart after the commit instead
of exiting, which torch would count as a failure.

The agent also leaves a note for its workers when it restarts them because a
member of the round is lost (:func:`note_peer_lost`): a worker that gets
SIGTERM then exits at once, since no step boundary can be reached with a lost
peer (see :class:`~elastic_ft.spot.watcher.SigtermHandler`).

The marker says which notice it answers. A SIGTERM notice is ambiguous to a
worker: its agent sends SIGTERM both when the node is stopped (container stop,
Batch TerminateJob: the agent itself got SIGTERM) and when it only restarts its
workers for a node that joins. So a ``sigterm`` marker makes the agent leave
only where it is exiting anyway (:func:`honoured`), never at a new round.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger(__name__)

RECLAIM_EXIT_CODE = 75
"""The exit status of a node that committed the job's state and left on a spot notice.

75 is ``EX_TEMPFAIL`` of sysexits.h ("temporary failure; the user is invited to
retry"): both the worker that left and, with the etcd3 rendezvous, its torchrun
agent exit with it. A scheduler should resubmit the node, as after a reclaim
(AWS Batch: ``evaluateOnExit`` ``{"onExitCode": "75", "action": "RETRY"}``);
torchrun itself exits 1 on a failure and 0 when the job completed.
"""

LEAVE_FILE_ENV = "ELASTIC_FT_LEAVE_FILE"
"""Set by the etcd3 handler in its agent's environment (inherited by the workers): the marker's path."""

AT_ROUND = "round"
"""Where the agent reads the marker: before joining a new round (its workers exited, it would restart them)."""
AT_EXIT = "exit"
"""Where the agent reads the marker: while it is exiting (no restarts left, or it got a signal)."""


@dataclass(frozen=True)
class LeaveMarker:
    kind: str
    """The notice the node leaves on: terminate, stop, hibernate or sigterm."""
    step: int
    """The step committed before the leave."""
    stays: bool = False
    """Written by the workers of a node that stays while others leave: its agent restarts them (see above)."""
    leaving: tuple[int, ...] = ()
    """In a marker that stays: the ranks in the round (``GROUP_RANK``) of the nodes that leave, so that the
    next round closes once the others are in (:mod:`elastic_ft.rendezvous.spot_leave`)."""


def _file_name_part(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:100]


DIR_PREFIX = "elastic_ft-leave-"


def marker_path(run_id: str, *, root: str | None = None) -> str:
    """A fresh marker path for one agent of ``run_id``, in a new private directory (0700, random name).

    ``root``: where the directory is made (default: the system's temporary
    directory). The caller removes the directory when it is done
    (:func:`remove_marker_dir`).
    """
    directory = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=root)
    return os.path.join(directory, f"{_file_name_part(run_id)}.{os.getpid()}.json")


def remove_marker_dir(path: str) -> None:
    """Remove the marker at ``path``, its lost note, any temp file and the directory :func:`marker_path` made."""
    directory = os.path.dirname(path)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except OSError as exc:  # a file written meanwhile: a few bytes left in the temporary directory
        log.debug("spot: could not remove %s (%s)", directory, exc)


_MARKER_NAME = re.compile(r"^(.*)\.(\d+)\.json$")


def _private_dir(directory: str) -> bool:
    """Whether ``directory`` is a real directory (not a symlink) of this user that no one else may enter."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


def marker_for_worker(environ: Mapping[str, str], parent_pid: int) -> str | None:
    """The marker path a worker writes, from its environment; None unless it is a worker of that agent.

    The variable is inherited by every descendant of the agent's process, also
    by processes that are not its workers (a process that built a handler
    itself, as a test runner does, may start others): only a direct child of
    the agent named in the path, started by torchrun for the same run id
    (``TORCHELASTIC_RUN_ID``), may make that agent leave, and only through a
    private directory of this user (as :func:`marker_path` makes it).
    """
    path = environ.get(LEAVE_FILE_ENV)
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    m = _MARKER_NAME.match(os.path.basename(path or ""))
    if m is None or run_id is None or m.group(1) != _file_name_part(run_id) or int(m.group(2)) != parent_pid:
        return None
    if not _private_dir(os.path.dirname(path)):
        log.warning("spot: ignoring %s=%s: its directory is not a private directory of this user",
                    LEAVE_FILE_ENV, path)
        return None
    return path


def write_marker(path: str, marker: LeaveMarker) -> None:
    """Write the marker atomically (a fresh temp file + rename): the agent never reads half of it.

    Several workers of one node may write it; each writes the same content.
    The temp file is made by ``mkstemp`` (a new random name, ``O_EXCL``: never
    an existing file or a symlink) and renamed over ``path`` (a rename replaces
    a symlink there, it does not follow it). The directory must exist (the
    agent made it).
    """
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".marker-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"kind": marker.kind, "step": marker.step, "stays": marker.stays,
                       "leaving": list(marker.leaving)}, f)
        os.replace(tmp, path)
    except BaseException:
        clear_marker(tmp)
        raise


def read_marker(path: str) -> LeaveMarker | None:
    """The marker at ``path``, or None when there is none (or it cannot be read, or is a symlink: then
    logged, and no leave)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc
        log.warning("spot: ignoring the leave marker %s (%s)", path, why)
        return None
    try:
        with os.fdopen(fd) as f:
            doc = json.load(f)
        return LeaveMarker(kind=str(doc["kind"]), step=int(doc["step"]), stays=doc.get("stays") is True,
                           leaving=tuple(int(r) for r in doc.get("leaving", ())))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("spot: ignoring the unreadable leave marker %s (%s)", path, exc)
        return None


def clear_marker(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def lost_note(leave_file: str) -> str:
    """The path of the agent's note to its workers that a member of the round is lost (beside the marker)."""
    return leave_file + ".lost"


def note_peer_lost(leave_file: str) -> None:
    """The agent is about to restart its workers because a member is lost: tell them (before the SIGTERM)."""
    try:  # never through a symlink; the directory is the agent's own (see marker_path)
        os.close(os.open(lost_note(leave_file), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    except OSError as exc:  # the workers then wait for a boundary, as without the note
        log.warning("spot: could not write %s (%s)", lost_note(leave_file), exc)


def peer_lost(leave_file: str) -> bool:
    """Whether the agent noted a lost member since the current round began."""
    return os.path.lexists(lost_note(leave_file))


def honoured(marker: LeaveMarker | None, where: str) -> bool:
    """Whether the agent leaves on ``marker`` at ``where`` (:data:`AT_ROUND` or :data:`AT_EXIT`).

    A notice from IMDS leaves wherever it is read. A SIGTERM leaves only at
    exit: before a new round it means the agent stopped its workers itself
    (a node joins), and the node stays. A marker of a node that stays never leaves.
    """
    if marker is None or marker.stays:
        return False
    return where == AT_EXIT or marker.kind != "sigterm"
