"""Where notices are posted: the IMDS poller thread, the SIGTERM handler, and the board they share.

The training loop reads :attr:`NoticeBoard.level`, a plain int, at each step
boundary: no lock, no I/O, nothing it could wait on. All the I/O happens on the
watcher's daemon thread, which sleeps on an event between polls and therefore
also stops at once when asked.

Not on EC2 the first probe finds no service: after :data:`PROBE_ATTEMPTS` such
attempts in a row the watcher logs one line and polls on quietly every
:data:`QUIET_INTERVAL_S` (a slow start on a loaded node must not blind a real
spot node for the whole run; off EC2 a probe every few minutes costs nothing).
Once the service has answered, a failing poll is logged once per streak of
failures and polling goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Callable

from elastic_ft.spot.imds import ImdsClient, ImdsError, ImdsUnavailable

log = logging.getLogger(__name__)

LEAVE_KINDS = ("terminate", "stop", "hibernate", "sigterm")
"""Notices after which this node is gone: the job must commit and leave."""
LEVEL_NONE, LEVEL_REBALANCE, LEVEL_LEAVE = 0, 1, 2
"""How urgent the board's notices are; ranks agree on the maximum."""
PROBE_ATTEMPTS = 3
QUIET_INTERVAL_S = 120.0
"""The polling interval after the probes found no service (bounded: a late service is still seen)."""


@dataclasses.dataclass(frozen=True)
class Notice:
    kind: str
    """terminate, stop, hibernate (IMDS instance action), rebalance (IMDS recommendation) or sigterm."""
    deadline: float | None
    """When the node goes, in epoch seconds; None when unknown (or for a rebalance recommendation)."""
    seen_at: float
    """When this process first saw it, in epoch seconds."""
    key: str
    """Identifies one notice: a repeated poll of the same document posts nothing new."""
    problem: str | None = None
    """Why the document was not taken as written (it was garbled), if so."""

    @property
    def level(self) -> int:
        return LEVEL_LEAVE if self.kind in LEAVE_KINDS else LEVEL_REBALANCE


class NoticeBoard:
    """The notices of this process. Thread-safe: the watcher and the SIGTERM thread post while the
    loop reads."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._leave: Notice | None = None
        self._rebalance: Notice | None = None
        self.level = LEVEL_NONE
        """The most urgent notice's level: read without the lock (an int attribute read is atomic)."""

    def post(self, notice: Notice) -> bool:
        """Record ``notice``; True if it is new. A leave notice is kept until the process ends (the node
        is going whatever polls say later), the one with the earliest known deadline winning."""
        with self._lock:
            if notice.level == LEVEL_LEAVE:
                old = self._leave
                if old is not None and (old.key == notice.key or not _earlier(notice.deadline, old.deadline)):
                    return False
                self._leave = notice
            else:
                if self._rebalance is not None and self._rebalance.key == notice.key:
                    return False
                self._rebalance = notice
            self.level = max(self.level, notice.level)
            return True

    def current(self) -> list[Notice]:
        """The leave notice (if any) first, then the newest rebalance recommendation (if any)."""
        with self._lock:
            return [n for n in (self._leave, self._rebalance) if n is not None]


def _earlier(new: float | None, old: float | None) -> bool:
    return new is not None and (old is None or new < old)


class Watcher:
    """Polls IMDS every ``interval_s`` on a daemon thread and posts what it finds to ``board``.

    ``speaks``: log at INFO/WARNING (else DEBUG). Every rank of a node polls
    the same IMDS and would print the same lines; one per node (its local rank
    0) is enough.
    """

    def __init__(self, board: NoticeBoard, client: ImdsClient, *, interval_s: float,
                 quiet_interval_s: float = QUIET_INTERVAL_S, wall: Callable[[], float] = time.time,
                 speaks: bool = True) -> None:
        self.board, self.client, self.interval_s, self.wall = board, client, interval_s, wall
        self._info = logging.INFO if speaks else logging.DEBUG
        self._warning = logging.WARNING if speaks else logging.DEBUG
        self.quiet_interval_s = max(interval_s, quiet_interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._answered = False  # the service has answered once: failures from now on are transient
        self._failed_probes = 0
        self._in_trouble = False
        self.quiet = False
        """True while the probes find no service at the endpoint (polling slowly)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spot-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling; waits for a poll in progress up to ``timeout_s`` (the thread is a daemon anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the watcher must outlive a bug in one poll: notices still matter
                log.exception("spot: unexpected error while polling IMDS; polling goes on")
            self._stop.wait(self.quiet_interval_s if self.quiet else self.interval_s)

    def poll_once(self) -> bool:
        """One poll; False when it failed. The instance action is posted before the rebalance
        recommendation is fetched: a failing second request must not hide a terminate notice."""
        try:
            action = self.client.instance_action()
            if action is not None:
                self._post(Notice(action.action, action.time, self.wall(), f"{action.action}@{action.time}",
                                  action.problem))
            rebalance = self.client.rebalance()
        except (ImdsUnavailable, ImdsError) as exc:
            return self._failed(exc)
        self._answered, self._failed_probes, self.quiet = True, 0, False
        if self._in_trouble:
            self._in_trouble = False
            log.log(self._info, "spot: IMDS at %s answers again", self.client.endpoint)
        now = self.wall()
        if rebalance is not None:
            key = f"rebalance@{rebalance.notice_time if rebalance.notice_time is not None else rebalance.raw}"
            self._post(Notice("rebalance", None, now, key, rebalance.problem))
        return True

    def _failed(self, exc: Exception) -> bool:
        if not self._answered:
            self._failed_probes += 1
            if self._failed_probes == PROBE_ATTEMPTS:
                self.quiet = True
                log.log(self._info, "spot: %s (%d attempts); not on EC2? Spot notices will come from SIGTERM (probing again "
                         "every %g s)", exc, self._failed_probes, self.quiet_interval_s)
            return False
        if not self._in_trouble:
            self._in_trouble = True
            log.log(self._warning, "spot: polling IMDS failed: %s; retrying every %g s", exc, self.interval_s)
        return False

    def _post(self, notice: Notice) -> None:
        if not self.board.post(notice):
            return
        left = "unknown" if notice.deadline is None else f"{notice.deadline - notice.seen_at:.0f} s"
        extra = f" ({notice.problem}: taken as shown)" if notice.problem else ""
        log.log(self._warning, "spot: %s notice from IMDS, time left %s%s", notice.kind, left, extra)


SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""The status of a worker that gave up waiting for a step boundary after SIGTERM (as a shell reports death by it)."""


def give_up_after_s(boundary_s: float, step_s: float | None) -> float:
    """How long after SIGTERM (or after the last step boundary since) the fallback waits for a boundary:
    ``boundary_s``, or two of the last measured steps when a step takes longer (a slow step is no hang)."""
    return boundary_s if step_s is None else max(boundary_s, 2.0 * step_s)


def _ignore(signum, frame) -> None:
    """The Python-level SIGTERM handler: nothing. The C-level handler behind it writes the signal number
    to the wakeup fd even while the main thread is blocked in C (a collective); a thread acts on it."""


class SigtermHandler:
    """SIGTERM as a notice: posts a ``sigterm`` notice due in ``grace_s``, and makes sure the process still ends.

    Once SIGTERM is handled, the process no longer dies of it: the training
    loop must reach a step boundary and act. A loop blocked in a collective
    with a peer that is gone (no TCP reset) would hold the agent up until its
    SIGKILL 30 s later, where the default action ended the worker at once; so
    if no step boundary (:meth:`boundary`) passes within
    :func:`give_up_after_s` of the signal or of the last boundary, and the loop
    is not already leaving (:meth:`answering`), the process exits with
    :data:`SIGTERM_EXIT_CODE`, as it would have without us. It exits at once
    where the agent noted a lost member before its SIGTERM (``peer_lost``).

    Python runs a signal handler only between bytecodes of the main thread,
    which a blocked collective never reaches; so the work happens on a daemon
    thread woken through :func:`signal.set_wakeup_fd`, written by CPython's
    C-level handler. That also keeps locks, logging and thread starts out of
    the signal handler (which could interrupt the main thread holding them).
    """

    def __init__(self, board: NoticeBoard, *, grace_s: float, boundary_s: float,
                 wall: Callable[[], float] = time.time, peer_lost: Callable[[], bool] | None = None) -> None:
        self.board, self.grace_s, self.boundary_s, self.wall = board, grace_s, boundary_s, wall
        self.peer_lost = peer_lost
        """Whether the agent noted a lost member of the round (:func:`elastic_ft.handoff.leave_marker.peer_lost`):
        then no boundary can come (a collective waits for the lost peer), and SIGTERM ends the process at once."""
        self.received = threading.Event()
        """Set once SIGTERM arrived."""
        self._answered = threading.Event()
        self._step_s: float | None = None
        self._deadline: float | None = None  # monotonic; set after SIGTERM, pushed back at each boundary
        self._previous = None
        self._previous_fd = -1
        self._wake: socket.socket | None = None
        self.installed = False

    def install(self) -> "SigtermHandler":
        """Only the main thread may install handlers; elsewhere this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            return self
        listen, self._wake = socket.socketpair()
        self._wake.setblocking(False)  # set_wakeup_fd requires it: a full buffer must not block the handler
        self._previous = signal.getsignal(signal.SIGTERM)
        self._previous_fd = signal.set_wakeup_fd(self._wake.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, _ignore)
        threading.Thread(target=self._watch, args=(listen,), name="spot-sigterm", daemon=True).start()
        self.installed = True
        return self

    def boundary(self, step_s: float | None) -> None:
        """The loop passed a step boundary (its last step took ``step_s``): a pending give-up starts anew."""
        self._step_s = step_s
        if self._deadline is not None:
            self._deadline = time.monotonic() + give_up_after_s(self.boundary_s, step_s)

    def answering(self) -> None:
        """The loop has reached a boundary and is acting on the notice: no exit behind its back."""
        self._answered.set()

    def restore(self) -> None:
        self.answering()
        if not self.installed:
            return
        self.installed = False
        if signal.getsignal(signal.SIGTERM) is _ignore:
            signal.signal(signal.SIGTERM, self._previous)
        signal.set_wakeup_fd(self._previous_fd)
        assert self._wake is not None
        self._wake.close()  # the thread reads end-of-file and ends

    def _watch(self, listen: socket.socket) -> None:
        with listen:
            while True:
                try:
                    data = listen.recv(64)
                except OSError:
                    return
                if not data:  # restored
                    return
                if signal.SIGTERM in data:  # other handled signals wake this fd too
                    break
        self.received.set()
        if not self._answered.is_set() and self.peer_lost is not None and self.peer_lost():
            self._give_up("the agent restarts the workers without a lost peer: no step boundary can come")
        now = self.wall()
        self._deadline = time.monotonic() + give_up_after_s(self.boundary_s, self._step_s)
        if self.board.post(Notice("sigterm", now + self.grace_s, now, "sigterm")):
            log.warning("spot: SIGTERM received; committing and leaving at the next step boundary")
        while not self._answered.wait(max(0.0, self._deadline - time.monotonic())):
            if time.monotonic() >= self._deadline:  # else a boundary pushed it back meanwhile
                self._give_up(f"no step boundary within {give_up_after_s(self.boundary_s, self._step_s):.3g} s "
                              f"(SIGTERM pending; a collective stuck on a lost peer?)")

    def _give_up(self, why: str) -> None:
        log.error("spot: %s; exiting as SIGTERM would have, without a checkpoint", why)
        logging.shutdown()
        os._exit(SIGTERM_EXIT_CODE)


def install_sigterm(board: NoticeBoard, *, grace_s: float, boundary_s: float = 10.0,
                    wall: Callable[[], float] = time.time,
                    peer_lost: Callable[[], bool] | None = None) -> SigtermHandler:
    """Make SIGTERM post a notice (see :class:`SigtermHandler`); ``restore()`` on the result undoes it."""
    return SigtermHandler(board, grace_s=grace_s, boundary_s=boundary_s, wall=wall, peer_lost=peer_lost).install()
