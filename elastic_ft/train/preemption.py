"""The workers' side of spot preemption: agree on notices at step boundaries, then act on the policy.

The agent's side is :mod:`elastic_ft.rendezvous.spot_leave`; what they exchange,
:mod:`elastic_ft.handoff.leave_marker`.

Every rank has a :class:`~elastic_ft.spot.watcher.Watcher` (IMDS) and a SIGTERM
handler posting to its own notice board. At step boundaries about half a
second apart (:func:`agree_every`; every boundary while a notice stands) the ranks
agree in one collective, an all-reduce MAX of three small integers on the process
group's device, whether any of them has a notice (the slowest step time and the
leader's checkpoint clock travel with it: :meth:`Preemption.agree`); only when one has do they
exchange the notices and follow the leader's :func:`~elastic_ft.spot.policy.decide`.
A decision that leaves commits the current step (or flushes the save in flight
that covers it), emits its events and raises :class:`Preempted`, which the
worker turns into exit code :data:`PREEMPTED_EXIT_CODE`. With the etcd3
rendezvous, the ranks of the nodes that stay first wait for their agent to
restart them in the smaller world (:meth:`Preemption._await_restart`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from elastic_ft.checkpoint.saver import AsyncSaver

from elastic_ft.checkpoint.save_errors import SaveFailed
from elastic_ft.config import SpotConfig
from elastic_ft.runevents.events import EventLog
from elastic_ft.spot.imds import ImdsClient
from elastic_ft.handoff import launch
from elastic_ft.handoff.leave_marker import RECLAIM_EXIT_CODE, LeaveMarker, marker_for_worker, peer_lost, write_marker
from elastic_ft.spot.policy import Decision, PolicySettings, Situation, decide, leaving_nodes
from elastic_ft.spot.watcher import LEVEL_LEAVE, LEVEL_NONE, Notice, NoticeBoard, SigtermHandler, Watcher, install_sigterm
from elastic_ft.train.metrics import Metrics
from elastic_ft.train.world import World, broadcast_from_leader, gather_from_all

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = RECLAIM_EXIT_CODE
"""A worker's exit status after it committed its state and left on a notice (75).

75 is ``EX_TEMPFAIL`` of sysexits.h ("temporary failure; the user is invited
to retry"): the work is safe and running the same command again resumes at
the next step. It is distinct from 0 (the run finished), 1 (a crash) and 2 (a
user error, see :mod:`elastic_ft.worker`). Every rank exits with it, also on
the nodes that stay: their agents see failed workers and restart them in a
smaller round at once, rather than waiting for a collective with the gone
ranks to fail. With the etcd3 rendezvous they first write a marker that makes
their agent restart them as for a change of membership, which costs none of
``--max-restarts``, and wait for it (:data:`RESTART_WAIT_S` at most). On the node that leaves, the workers
first write the leave marker (:mod:`elastic_ft.handoff.leave_marker`): with the etcd3
rendezvous its agent then leaves the rendezvous instead of restarting them and
exits with :data:`~elastic_ft.handoff.leave_marker.RECLAIM_EXIT_CODE` too. With another
rendezvous torchrun treats the exit as a failure (restarts the workers, which
leave again while the notice stands, then exits 1 naming exit code 75).
"""


RESTART_WAIT_S = 30.0
"""How long the ranks of a node that stays wait, after the commit, for their agent to restart them (it
looks for their marker every monitor interval, 0.1 s by default); then they exit, costing a restart."""


class Trainer(Protocol):
    """What the response needs of the trainer (:class:`elastic_ft.train.loop.Trainer`), named here so
    that this module does not import the loop that imports it."""

    step: int
    last_ckpt_step: int
    """The newest step a save was submitted for (in flight or committed)."""
    last_committed_step: int
    """The newest step whose manifest landed (known to the leader, which decides)."""
    last_commit_s: float | None
    last_step_s: float | None
    saver: AsyncSaver
    metrics: Metrics

    def save(self, reason: str, *, sync: bool = False) -> None: ...


class Preempted(Exception):
    """The run left on a spot notice after committing its state (raised on every rank alike)."""

    def __init__(self, step: int, kind: str, *, stays: bool = False) -> None:
        self.step, self.kind, self.stays = step, kind, stays
        if stays:
            super().__init__(f"other node(s) left on a {kind} notice at step {step}, state committed; this node "
                             f"goes on in a new round from step {step + 1}")
        elif kind == "sigterm":
            # A worker cannot tell why SIGTERM came: its agent sends it when the node is stopped
            # (container stop, TerminateJob) and also when it only restarts its workers for a node
            # that joins. "preempted" would be wrong for the second.
            super().__init__(f"stopped by SIGTERM at step {step}, state committed (torchrun restarts its workers "
                             f"this way when a node joins; a container stop sends it too); the next start resumes "
                             f"at step {step + 1}")
        else:
            super().__init__(f"preempted: left on a {kind} notice at step {step}, state committed; running the "
                             f"same command again resumes at step {step + 1}")


def most_urgent(notices: list[Notice]) -> Notice | None:
    """The notice to act on: leave before rebalance, then the earliest known deadline."""
    if not notices:
        return None
    return min(notices, key=lambda n: (-n.level, n.deadline is None, n.deadline or 0.0))


AGREE_WITHIN_S = 0.5
"""The longest a notice waits, in steps of this many seconds, before the ranks next agree on it: half a
second, as every second of it delays the survivors' next step after a leave."""

_MAX_STEP_US = 2**31 - 1  # a step time in us is clamped to it (35 min; any step over 0.5 s agrees each time)


def agree_every(step_s: float) -> int:
    """How many step boundaries apart the ranks agree on notices, given the slowest rank's step time.

    An agreement is an all-reduce and a read of its result (on NCCL a device
    sync), about 0.15 ms on gloo: once per step it costs ~1 % of a 15 ms
    step. Agreeing every ``K`` steps with ``K * step_s <= AGREE_WITHIN_S``
    keeps it under ~0.03 % while a notice waits at most about half a second
    (a spot notice gives two minutes, but the survivors wait for the leave). A step of ``AGREE_WITHIN_S`` or longer,
    or an unknown one (0: before the first step), agrees at every boundary.
    """
    if step_s <= 0:
        return 1
    return max(1, int(AGREE_WITHIN_S / step_s))


class NoticePoll:
    """Whether any rank has a notice to leave, asked between the micro-batches of a long computation (an evaluation)
    that a notice must not hold up, the ranks agreeing as at a step boundary.

    :meth:`post` starts an all-reduce MAX of this rank's notice level (one int64 on the process group's device,
    asynchronous); :meth:`standing` waits for the last one posted and tells whether any rank had a notice.
    Posting after a micro-batch is queued and reading after the next one is, the read waits only for work
    already done (on NCCL a device sync one micro-batch behind, not a stall per micro-batch); a notice then
    stops the computation one micro-batch later than it could. Every rank posts and reads alike. Without a
    process group it reads the board. Cost: one small all-reduce per micro-batch (about 0.15 ms on gloo).
    """

    def __init__(self, world: World, board: NoticeBoard) -> None:
        self.world, self.board = world, board
        self._flag = torch.zeros(1, dtype=torch.int64, device=world.device) if world.distributed else None
        self._work = None

    def post(self) -> None:
        if self._flag is None:
            return
        self._flag.fill_(self.board.level)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def standing(self) -> bool:
        """Whether any rank had a notice to leave at the last :meth:`post` (False before any post). A rebalance
        recommendation does not stop the computation: it asks for an early checkpoint, not a leave."""
        if self._flag is None:
            return self.board.level >= LEVEL_LEAVE
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        return int(self._flag.item()) >= LEVEL_LEAVE

    def drain(self) -> None:
        """Wait for a posted all-reduce not read yet (before the ranks' next collective)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def _node() -> str:
    """This process's node: torchrun's ``GROUP_RANK`` (its agent's rank in the round; "0" without torchrun)."""
    return os.environ.get("GROUP_RANK", "0")


class Preemption:
    """One per worker: the watcher, the SIGTERM handler and the boundary check. :meth:`close` undoes them."""

    def __init__(self, cfg: SpotConfig, world: World, events: EventLog, *, endpoint: str) -> None:
        self.cfg, self.world, self.events = cfg, world, events
        self.board = NoticeBoard()
        self.settings = PolicySettings(on_rebalance=cfg.on_rebalance, train_until_deadline=cfg.train_until_deadline,
                                       margin_s=cfg.margin_s)
        # [notice level, slowest step in us, leader's checkpoint age in ms, leader's checkpoint interval],
        # allocated once on the process group's device; int64: the age may reach every_seconds' bound (1e8 s).
        self._flag = torch.zeros(4, dtype=torch.int64, device=world.device)
        self._skip = 0  # boundaries left before the next agreement (the same on every rank)
        self.checkpoint_age_s: float | None = None  # the leader's, as the last boundary agreed (see agree)
        self.agreed_interval: int | None = None  # the leader's checkpoint.every_steps: auto, likewise
        self.agreed_level = LEVEL_NONE
        """The notice level the ranks last agreed on (:meth:`agree`), the same on every rank; while it is
        :data:`LEVEL_LEAVE` every boundary agrees again."""
        self._handled: set[str] = set()  # rebalance recommendations already answered
        self._announced: set[str] = set()  # notices whose "none" decision was already an event
        self.watcher: Watcher | None = None
        self.sigterm: SigtermHandler | None = None
        # This worker's channel to its agent: set by the etcd3 rendezvous only.
        self.marker = marker_for_worker(os.environ, launch.agent_pid())
        if cfg.enabled:
            client = ImdsClient(endpoint, timeout_s=cfg.imds_timeout_s, token_ttl_s=cfg.token_ttl_s)
            self.watcher = Watcher(self.board, client, interval_s=cfg.poll_interval_s, speaks=world.local_rank == 0)
            self.watcher.start()
            if cfg.sigterm:
                lost = None if self.marker is None else functools.partial(peer_lost, self.marker)
                self.sigterm = install_sigterm(self.board, grace_s=cfg.sigterm_grace_s,
                                               boundary_s=cfg.sigterm_boundary_s, peer_lost=lost)

    def agree(self, step_s: float | None = None, checkpoint_age_s: float | None = None,
              interval: int | None = None) -> int:
        """The most urgent notice level of any rank (one all-reduce at the boundaries where ranks agree).

        With several ranks the all-reduce happens even where spot is disabled
        (its board stays empty: it reports no notice and follows the others),
        since ``spot.enabled`` may differ between nodes and every rank must
        make the same collectives. ``step_s`` is this rank's last step time
        (``None`` before the first step); see :func:`agree_every` for which
        boundaries agree. Between them this returns :data:`LEVEL_NONE`.

        ``checkpoint_age_s``: the seconds since the last checkpoint by this
        rank's clock, or None when no time rule applies. The leader's value
        travels with the level, and :attr:`checkpoint_age_s` holds it after
        the call on every rank alike (None at a boundary that did not agree):
        ``checkpoint.every_seconds`` then picks the same step on every rank
        without an object broadcast of its own per step (clocks differ).
        ``interval``: the leader's checkpoint interval (``checkpoint.every_steps: auto``), which travels the
        same way into :attr:`agreed_interval` (None where this boundary did not agree or it proposed none).
        """
        if not self.world.distributed:
            self.checkpoint_age_s, self.agreed_interval = checkpoint_age_s, interval
            self.agreed_level = self.board.level
            return self.agreed_level
        if self._skip > 0:
            self._skip -= 1
            self.checkpoint_age_s = self.agreed_interval = None
            return LEVEL_NONE
        # The slowest rank's step time travels with the level (both MAX), so every rank
        # derives the same cadence from the same agreed value; only the leader's clock counts (-1 elsewhere).
        step_us = min(_MAX_STEP_US, round((step_s or 0.0) * 1e6))
        age_ms = -1 if checkpoint_age_s is None or not self.world.is_leader else round(checkpoint_age_s * 1e3)
        proposed = -1 if interval is None or not self.world.is_leader else interval
        self._flag.copy_(torch.tensor([self.board.level, step_us, age_ms, proposed], dtype=torch.int64))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        level, slowest_us, agreed_ms, agreed_steps = self._flag.tolist()  # one read: one device sync on NCCL
        self._skip = 0 if level != LEVEL_NONE else agree_every(slowest_us / 1e6) - 1
        self.checkpoint_age_s = None if agreed_ms < 0 else agreed_ms / 1e3
        self.agreed_interval = None if agreed_steps < 0 else agreed_steps
        self.agreed_level = level
        return level

    @property
    def leave_standing(self) -> bool:
        """Whether the last agreement found a notice to leave on some rank (the decision may have been to
        train on: ``spot.train_until_deadline``). The same on every rank: work that a notice abandons (an
        evaluation) is not started while it holds, the caller leaves instead (:meth:`leave_now`)."""
        return self.agreed_level >= LEVEL_LEAVE

    def poll(self) -> NoticePoll:
        """A poll of every rank's notices between the micro-batches of an evaluation (see :class:`NoticePoll`)."""
        return NoticePoll(self.world, self.board)

    def agree_next(self) -> None:
        """Make the next step boundary agree, whatever its cadence: every rank calls it alike (an evaluation
        abandoned on a notice), so the leave follows at once instead of after the skipped boundaries."""
        self._skip = 0

    def at_boundary(self, trainer: Trainer, *, checkpoint_age_s: float | None = None,
                    interval: int | None = None) -> float | None:
        """Called by every rank between steps; raises :class:`Preempted` after committing, when leaving.

        Returns the leader's ``checkpoint_age_s`` as agreed (see :meth:`agree`), the same on every rank;
        None where this boundary did not agree, or after an early checkpoint made here.
        """
        level = self.agree(trainer.last_step_s, checkpoint_age_s, interval)
        if self.sigterm is not None:
            self.sigterm.boundary(trainer.last_step_s)  # a boundary passed: no give-up while steps go on
        if level == LEVEL_NONE:
            return self.checkpoint_age_s
        return self._respond(trainer, *self._decide(trainer, self.settings))

    def leave_now(self, trainer: Trainer, why: str) -> None:
        """Commit and leave on the standing notice (:attr:`leave_standing`) at once, whatever
        ``spot.train_until_deadline`` would decide: called by every rank alike (the agreed level is the same
        on all) where the next work cannot finish under the notice (an evaluation that it would abandon at
        every try). Raises :class:`Preempted`; ``why`` goes into the ``spot_decision`` event's reason."""
        leave = dataclasses.replace(self.settings, train_until_deadline=False)
        notice, decision, leaving = self._decide(trainer, leave)
        self._respond(trainer, notice, dataclasses.replace(decision, reason=f"{decision.reason}; {why}"), leaving)

    def _respond(self, trainer: Trainer, notice: Notice, decision: Decision, leaving: frozenset[str]) -> float | None:
        """Act on the leader's decision (every rank alike): its event, an early checkpoint or the leave."""
        if decision.leaves and self.sigterm is not None:
            self.sigterm.answering()  # at a boundary, committing: the SIGTERM fallback must not cut in
        if decision.action == "early_checkpoint":
            self._handled.add(notice.key)  # one early checkpoint per recommendation
        if decision.action == "none" and notice.key in self._announced:
            return self.checkpoint_age_s
        self._announced.add(notice.key)
        left = None if notice.deadline is None else round(notice.deadline - time.time(), 1)
        self.events.emit("spot_decision", step=trainer.step, action=decision.action, reason=decision.reason,
                         notice=notice.kind, seconds_left=left, problem=notice.problem)
        if decision.action == "early_checkpoint":
            trainer.save(f"spot: {decision.reason}")
            return None  # the agreed age predates this save
        if decision.leaves:
            self._leave(trainer, notice, decision, leaving)
        return self.checkpoint_age_s

    def _decide(self, trainer: Trainer, settings: PolicySettings) -> tuple[Notice, Decision, frozenset[str]]:
        """Every rank's notices to the leader, whose decision (and the notice it acted on) all ranks follow;
        also the nodes (``GROUP_RANK``) that leave on it.

        The leader decides because only it knows which checkpoint committed
        last, and because each rank's view of the save in flight may differ.
        """
        reports = gather_from_all(self.world, (_node(), self.board.current()))
        notices = [n for _, per_rank in reports for n in per_rank]
        choice = None
        if self.world.is_leader:
            notice = most_urgent(notices)
            assert notice is not None  # some rank reported a level above none
            covers = trainer.last_ckpt_step == trainer.step and trainer.last_committed_step != trainer.step
            situation = Situation(
                kind=notice.kind, deadline=notice.deadline, now=time.time(), commit_s=trainer.last_commit_s,
                steps_since_commit=trainer.step - trainer.last_committed_step, in_flight_covers_step=covers,
                step_s=trainer.last_step_s, rebalance_handled=notice.key in self._handled,
            )
            leaving = leaving_nodes((n, [x.level for x in per_rank]) for n, per_rank in reports)
            choice = (notice, decide(situation, settings), leaving)
        return broadcast_from_leader(self.world, choice)

    def _leave(self, trainer: Trainer, notice: Notice, decision: Decision, leaving: frozenset[str]) -> None:
        """Commit, write the leave marker where this rank's node leaves, raise :class:`Preempted`."""
        t0 = time.monotonic()
        trainer.metrics.flush()
        if decision.action == "checkpoint_and_leave":
            trainer.save(f"spot: {decision.reason}", sync=True)
        else:
            try:
                trainer.saver.flush()
            except SaveFailed as exc:  # the same on every rank (see AsyncSaver): commit the step ourselves
                log.warning("spot: the save in flight failed (%s); committing the current step synchronously", exc)
                trainer.save(f"spot: {decision.reason}; the save in flight failed", sync=True)
        stays = _node() not in leaving
        if self.marker:  # only after the commit: the agent leaves for good on it, or restarts this node's workers
            write_marker(self.marker, LeaveMarker(kind=notice.kind, step=trainer.step, stays=stays,
                                                  leaving=tuple(sorted(int(n) for n in leaving)) if stays else ()))
        self.events.emit("preempted", step=trainer.step, notice=notice.kind, exit_code=PREEMPTED_EXIT_CODE,
                         leaving_nodes=sorted(leaving), seconds=round(time.monotonic() - t0, 3))
        if self.marker and stays:
            self._await_restart()
        raise Preempted(trainer.step, notice.kind, stays=stays)

    def _await_restart(self, timeout_s: float = RESTART_WAIT_S) -> bool:
        """Wait for the agent's SIGTERM (it restarts this node's workers on their marker); whether it came.

        Without the SIGTERM handler the signal's default action ends the process during the wait.
        """
        received = self.sigterm.received if self.sigterm is not None else threading.Event()
        if received.wait(timeout_s):
            return True
        log.warning("spot: the agent did not restart the workers within %g s of the leave; exiting (it counts "
                    "as one of --max-restarts)", timeout_s)
        return False

    def close(self) -> None:
        if self.sigterm is not None:
            self.sigterm.restore()
        if self.watcher is not None:
            self.watcher.stop(timeout_s=0.5)  # a daemon: a poll in flight need not hold up the exit
