"""``checkpoint.every_steps: auto``: the interval between commits chosen from the run's own figures.

:func:`choose_interval` is the decision (pure): Young's first-order optimum, the interval that minimises
the expected time lost per unit of training, ``tau = sqrt(2 * C * MTBF)`` seconds of training between
commits, where C is what a commit costs the training (the seconds a save blocks it: the host copy of an
async save, and any wait for the previous upload; a synchronous save's whole time) and MTBF the run's mean
time between losses; in steps, ``tau / step time``, rounded and clamped to ``[1, bound]``. (Daly's
higher-order terms shorten tau by under 5 % while C < MTBF / 100, as for any save that blocks training for
seconds against losses minutes apart; the restart cost does not move the optimum.)

The MTBF is the run's observed one (:mod:`elastic_ft.runevents.attempt_history`: attempts lost, over the
time the run trained) once it has lost an attempt; before that, the larger of ``checkpoint.auto_mtbf_s``
and the time it has trained without a loss.

:class:`AutoInterval` holds the figures as the run goes: on the leader, the history read at the
(re)start, a moving average of the step time and of the commit cost the saves measure; the leader
proposes an interval at each step boundary, and the interval travels to every rank in the boundary's
existing agreement (:meth:`elastic_ft.train.preemption.Preemption.agree`), so every rank checkpoints at
the same steps without a collective of its own. The interval changes only when the figures move it by
:data:`MATERIAL` (and a whole step) or more, each change one ``checkpoint_interval`` event (old, new, reason).

Cost per step: a few float operations on the leader (constant: nothing grows with the run, the model or
the nodes); at a (re)start, the leader's history read (bounded, see its module).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.config import CheckpointConfig
from elastic_ft.config.limits import MAX_STEPS
from elastic_ft.runevents.attempt_history import AttemptHistory, read_history

log = logging.getLogger(__name__)

MATERIAL = 0.2
"""A new interval replaces the current one when they differ by this fraction of the current or more: the
figures are noisy (a save's blocking time varies by milliseconds), and each change is an event."""

_STEP_SMOOTHING = 0.1  # per step: a few dozen steps' average, past a slow first step (warm-up, compilation)
_COMMIT_SMOOTHING = 0.2  # per save: a few saves' average (a save's blocking time varies by half)


@dataclasses.dataclass(frozen=True)
class Interval:
    steps: int
    reason: str
    mtbf_s: float
    ideal: float
    """Young's interval in steps before rounding and clamping: what :func:`material` compares."""


def mean_time_between_losses(losses: int, exposure_s: float, prior_s: float) -> float:
    """The run's MTBF: ``exposure_s / losses`` after a loss (at least a second), else the larger of the prior
    and the time trained without one (a run that lasted longer than the prior has shown it is better)."""
    if losses <= 0:
        return max(prior_s, exposure_s)
    return max(1.0, exposure_s / losses)


def choose_interval(*, commit_s: float, step_s: float, losses: int, exposure_s: float, prior_mtbf_s: float,
                    bound: int = MAX_STEPS, commit_assumed: bool = False) -> Interval:
    """The interval in steps, and why (see the module's docstring).

    ``commit_s``: seconds of training a commit costs (>= 0); ``step_s``: seconds per step (> 0);
    ``losses`` over ``exposure_s`` seconds trained; ``prior_mtbf_s`` while there was no loss;
    ``commit_assumed``: C is a stand-in, not measured (said in the reason). Raises ValueError on a
    step time that is not positive and finite, or a negative or non-finite commit cost.
    """
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"the step time must be a positive number of seconds, got {step_s!r}")
    if not (math.isfinite(commit_s) and commit_s >= 0):
        raise ValueError(f"the commit cost must be a number of seconds >= 0, got {commit_s!r}")
    mtbf = mean_time_between_losses(losses, exposure_s, prior_mtbf_s)
    ideal = math.sqrt(2.0 * commit_s * mtbf) / step_s
    steps = int(min(bound, max(1, round(ideal))))
    seen = (f"{losses} loss{'es' if losses != 1 else ''} in {duration(exposure_s)}" if losses > 0 else
            f"no loss in {duration(exposure_s)}; prior {duration(prior_mtbf_s)}")
    clamped = f" (clamped to [1, {bound}] from {ideal:.3g})" if steps != round(ideal) else ""
    c = f"C={commit_s:.3g}s{' (assumed: one step, no save measured yet)' if commit_assumed else ''}"
    return Interval(steps, f"Young/Daly: {c}, MTBF={mtbf:.0f}s ({seen}), step {step_s:.3g} s -> every {steps} "
                           f"steps{clamped}", mtbf, ideal)


def material(old: Interval | None, new: Interval) -> bool:
    """Whether ``new`` replaces ``old`` (see :data:`MATERIAL`); always when there is none yet.

    Compared before rounding and by a whole step at least (a short interval would flip between 3 and 4
    steps on a few milliseconds' noise in C), within the bounds (a clamped interval stays while the
    figures keep it clamped)."""
    if old is None:
        return True
    if old.steps == new.steps:
        return False
    lo, hi = sorted((max(1.0, old.ideal), max(1.0, new.ideal)))
    return hi - lo >= max(1.0, MATERIAL * lo)


def duration(seconds: float) -> str:
    """``41 s``, ``12 min``, ``3.2 h``: a reason's time, as a person reads it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _smooth(average: float | None, value: float, weight: float) -> float:
    return value if average is None else (1 - weight) * average + weight * value


class AutoInterval:
    """The interval every rank follows (:attr:`steps`) and, on the leader, the figures it is chosen from.

    Inert (:attr:`steps` None, no proposal) unless ``checkpoint.every_steps`` is ``auto``. ``events`` is the
    trainer's event log (it writes on the leader only).
    """

    def __init__(self, cfg: CheckpointConfig, *, leader: bool, events) -> None:
        self.enabled = cfg.every_steps == "auto"
        self.prior_s, self.leader, self.events = cfg.auto_mtbf_s, leader, events
        self.steps: int | None = None
        """The agreed interval, the same on every rank; None until the first agreement with figures."""
        self.history = AttemptHistory()
        self.started: float | None = None  # wall clock: the current attempt's exposure runs from it
        self.step_s: float | None = None
        self.commit_s: float | None = None
        self._last_commit: float | None = None  # the saves' last measurement, as last seen (novelty test)
        self._proposal: Interval | None = None  # the leader's last proposal (its reason, for the event)
        self._basis: Interval | None = None  # the figures behind the interval in force (the leader's)

    def start(self, store: ObjectStore, attempt: int, now: float) -> None:
        """The leader, at a (re)start: read the run's earlier attempts from ``store`` (the run's location) and
        :meth:`begin` with them; a read that fails (a store that cannot answer after its own retries, an object
        it cannot use) leaves the prior, logged: the interval is advice, and the next restart reads again."""
        if not (self.enabled and self.leader):
            return
        try:
            history = read_history(store, attempt)
        except Exception as exc:  # noqa: BLE001 - advice only: no read (store, a malformed object) may stop a start
            log.warning("checkpoint interval: the run's earlier attempts could not be read (%s); assuming no loss "
                        "so far (checkpoint.auto_mtbf_s)", exc)
            history = AttemptHistory()
        self.begin(history, now)

    def begin(self, history: AttemptHistory, now: float) -> None:
        """The earlier attempts' figures seed this attempt's (its exposure runs from its claim, else ``now``)."""
        self.history, self.started = history, history.current_start or now
        self.step_s, self.commit_s = history.step_s, history.commit_s

    def propose(self, now: float, step_s: float | None, commit_s: float | None) -> int | None:
        """The leader's interval for the next agreement (None elsewhere, when inert, or before a step time).

        ``step_s``: the leader's last step time; ``commit_s``: the last save's blocking time (as the
        checkpoints record it; a value not seen before is a new save). Called at every step boundary.
        """
        if not (self.enabled and self.leader):
            return None
        if step_s is not None and step_s > 0:
            self.step_s = _smooth(self.step_s, step_s, _STEP_SMOOTHING)
        if commit_s is not None and commit_s != self._last_commit:
            self._last_commit = commit_s
            self.commit_s = _smooth(self.commit_s, commit_s, _COMMIT_SMOOTHING)
        if self.step_s is None:
            return self.steps
        h = self.history
        exposure = h.exposure_s + max(0.0, now - (self.started if self.started is not None else now))
        choice = choose_interval(commit_s=self.step_s if self.commit_s is None else self.commit_s,
                                 step_s=self.step_s, losses=h.losses, exposure_s=exposure,
                                 prior_mtbf_s=self.prior_s, commit_assumed=self.commit_s is None)
        if self.steps is not None and not material(self._basis, choice):
            return self.steps
        self._proposal = choice
        return choice.steps

    def adopt(self, agreed: int | None, *, step: int) -> None:
        """Every rank, after a boundary: follow the agreed interval (None: this boundary did not agree); a
        change is one ``checkpoint_interval`` event, with the leader's reason."""
        if not self.enabled or agreed is None or agreed == self.steps:
            return
        old, self.steps = self.steps, agreed
        p = self._proposal
        if p is not None and p.steps == agreed:
            self._basis = p
        reason = p.reason if p is not None and p.steps == agreed else "the leader's choice"
        self.events.emit("checkpoint_interval", step=step, old=old, new=agreed, reason=reason)
