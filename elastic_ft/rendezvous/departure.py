"""The agent's side of a node's leave on a spot notice (the workers' side: :mod:`elastic_ft.spot.leave`).

:class:`NodeLeft` is how the etcd3 handler ends its torchrun agent with the
reclaim status; :func:`hand_leave_file` gives the agent its marker path, hands
it to the workers through the environment, and reads it once more at exit;
:func:`peers_leave` tells it that its workers stay while other nodes leave.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Protocol

from ..spot.leave import AT_EXIT, LEAVE_FILE_ENV, RECLAIM_EXIT_CODE, LeaveMarker, clear_marker, marker_path, read_marker


class _Leaving(Protocol):
    """What this module needs of :class:`~elastic_ft.rendezvous.handler.EtcdRendezvousHandler`
    (named here, not imported: the handler imports this module)."""

    leave_file: str | None

    def _leave_if_told(self, where: str) -> None: ...


class NodeLeft(SystemExit):
    """Ends a torchrun agent whose node left on a spot notice, with :data:`RECLAIM_EXIT_CODE`.

    A ``SystemExit`` rather than torch's ``RendezvousGracefulExitError``: torch
    2.13's ``SimpleElasticAgent.run()`` swallows that error and returns None,
    which ``launch_agent`` then dereferences (an AttributeError: exit 1 with a
    traceback). A ``SystemExit`` passes torch's ``except Exception`` clauses
    while their ``finally`` clauses still stop the workers and call
    ``shutdown()``, and torchrun exits with its code.
    """

    def __init__(self) -> None:
        super().__init__(RECLAIM_EXIT_CODE)


def hand_leave_file(handler: _Leaving, run_id: str) -> None:
    """Give the agent a fresh leave marker path, tell its workers (environment), and read it at exit.

    At exit: a torchrun agent stopped by a signal (a container stop) never calls
    ``shutdown()`` (torch keeps the rendezvous open for the others), so an
    ``atexit`` hook leaves for a node whose workers left on the signal.
    """
    handler.leave_file = marker_path(run_id)
    clear_marker(handler.leave_file)
    os.environ[LEAVE_FILE_ENV] = handler.leave_file
    # A strong reference: after a signal, torch's frames that held the handler are gone.
    atexit.register(_leave_at_exit, handler)


def peers_leave(leave_file: str | None) -> LeaveMarker | None:
    """The marker of the agent's workers when they stay while other nodes leave (they committed and wait
    for a restart in a new round), or None. Cheap without one (a stat): called every monitor interval."""
    if not leave_file or not os.path.exists(leave_file):
        return None
    marker = read_marker(leave_file)
    return marker if marker is not None and marker.stays else None


def _leave_at_exit(handler: _Leaving) -> None:
    try:
        handler._leave_if_told(AT_EXIT)  # our method (not torch's)
    except NodeLeft as exc:
        # An exception from an atexit hook would only be printed: end the
        # process with the reclaim status instead (the workers are gone).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(exc.code))
