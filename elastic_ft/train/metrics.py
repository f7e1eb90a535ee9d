"""Step metrics: the loss, throughput and ETA of finished steps, as events and progress lines.

A step's time is taken when it ends (``t_end``), not when it is reported, so a
plot of its events against time has no staircase. Losses are token-weighted
over the whole world and reduced in one collective per reporting interval, not
per step, which keeps the metric off the step's critical path. Every rank
reports the same steps at the same points, since the reduction is a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch

from elastic_ft.runevents.events import EventLog
from elastic_ft.train.world import World, sum_over_ranks

log = logging.getLogger("elastic_ft.train.loop")  # the name the progress lines always had

MAX_RECORDS = 30_000
"""Events :attr:`Metrics.records` holds at most (three per step: 10,000 steps between two saves)."""


@dataclasses.dataclass
class StepResult:
    """A finished optimizer step, whose metrics may not be reported yet."""

    step: int
    """Steps completed, this one included."""
    lr: float
    tokens: int
    """Global target tokens of the step."""
    consumed: list | None
    """Per rank, the (epoch, index) samples processed (ledger only)."""
    loss_sum: torch.Tensor
    """This rank's summed token loss, on the world's device; the global sum (on the host) once
    :meth:`Metrics.flush` ran."""
    seconds: float = float("nan")
    skipped: str | None = None
    """Why the update was skipped (a non-finite gradient), or None."""
    t_end: float = float("nan")
    """Wall-clock time (epoch seconds) the step ended."""
    eta_s: float = float("nan")
    """Seconds left to the run's last step, estimated when the step ended (NaN: unknown yet)."""
    real_tokens: int | None = None
    """Global tokens of the step's samples (no padding)."""
    computed_tokens: int | None = None
    """Global token positions its micro-batches computed, padding included (lockstep's repeats not counted)."""

    @property
    def loss(self) -> float:
        return float(self.loss_sum) / max(1, self.tokens)


class Metrics:
    """The steps not reported yet, and what reporting them needs (the run's length, its start, its last loss)."""

    def __init__(self, world: World, events: EventLog, *, total_steps: int, every_steps: int,
                 each_step: bool = False) -> None:
        self.world, self.events = world, events
        self.each_step = each_step
        """Report every step when it ends (its loss all-reduce included; the progress line still every
        ``every_steps``): a run that keeps each step in memory may resume from any step, and its events must
        hold every step before it (:attr:`records` carries them to the resume)."""
        self.records: list[tuple[str, dict]] = []
        """With ``each_step``: the ``step`` and ``ledger`` events reported since the caller last cleared it, as
        (event, fields), on every rank (the leader's file has them; a kept step carries them, see
        :meth:`elastic_ft.train.loop.Trainer.resume`)."""
        self.total_steps, self.every_steps = total_steps, every_steps
        self.last_loss: float | None = None
        """The global loss of the newest reported (not skipped) step; None before any."""
        self._unreported: list[StepResult] = []
        self.t_start = time.monotonic()
        self._first: tuple[int, float] | None = None
        """(step, end time) of the first step since the (re)start: the ETA's origin."""

    def start(self) -> None:
        """The run (re)starts training now: the ETA counts from its first step's end."""
        self.t_start, self._first = time.monotonic(), None

    def add(self, result: StepResult) -> None:
        """Queue a finished step; report the queue every ``logging.every_steps`` steps and at the last."""
        if self._first is None:
            self._first = (result.step, result.t_end)
        result.eta_s = eta_seconds(*self._first, result.step, result.t_end, self.total_steps)
        self._unreported.append(result)
        if self.each_step or result.step % self.every_steps == 0 or result.step == self.total_steps:
            self.flush()

    def flush(self) -> None:
        """Report the steps not reported yet: one all-reduce for all their losses.

        Token-weighted: the global loss of a step is the sum of the ranks' token
        loss sums over its global token count, not a mean of per-rank means.
        Called on every rank at the same points (it is a collective); a no-op
        when nothing is queued.
        """
        if not self._unreported:
            return
        sums = torch.stack([r.loss_sum.to(self.world.device) for r in self._unreported])
        sum_over_ranks(self.world, sums)
        for r, total in zip(self._unreported, sums.cpu()):  # one read of the device for all of them
            r.loss_sum = total
            self.report(r)
        self._unreported.clear()

    def _emit(self, event: str, **fields) -> None:
        self.events.emit(event, quiet=True, **fields)
        if self.each_step:
            self.record(event, fields)

    def record(self, event: str, fields: dict) -> None:
        """Add to :attr:`records`; past :data:`MAX_RECORDS` the oldest go (a run that never saves by steps
        would otherwise grow them, and the kept step's sidecar that carries them, without bound)."""
        self.records.append((event, fields))
        if len(self.records) > MAX_RECORDS:
            del self.records[: len(self.records) - MAX_RECORDS]

    def report(self, r: StepResult) -> None:
        """Events and the progress line of a finished step."""
        w = self.world
        if r.consumed is not None:
            self._emit("ledger", step=r.step - 1, samples=r.consumed)
        if r.skipped is not None:
            return  # its step_skipped event was emitted when it happened
        loss = r.loss
        self.last_loss = loss
        eta = r.eta_s
        self._emit(
            "step", step=r.step, t_end=number(round(r.t_end, 3)), loss=round(loss, 6), lr=r.lr,
            tokens=r.tokens, tokens_per_s=round(r.tokens / r.seconds, 1), world=w.size,
            eta_s=round(eta, 1) if math.isfinite(eta) else None,
            **({} if r.real_tokens is None else {"real_tokens": r.real_tokens, "computed_tokens": r.computed_tokens}),
        )
        if w.is_leader and (r.step % self.every_steps == 0 or r.step == self.total_steps):
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | %s tok/s | world %d | eta %s", r.step, self.total_steps,
                loss, r.lr, f"{r.tokens / r.seconds:,.0f}", w.size, fmt_eta(eta),
            )


def eta_seconds(first_step: int, first_end: float, step: int, end: float, total_steps: int) -> float:
    """Seconds to ``total_steps``: the mean time per step since the (re)start, times the steps left.

    The mean runs from the end of the attempt's first step (``first_step``,
    ended at ``first_end``) to the end of ``step`` (at ``end``), so neither
    start-up and loading nor the first step (warm-up, a slow first batch)
    count, while the checkpoints and other work between steps do. NaN until a
    second step of the attempt has ended; 0 at the last step.
    """
    if step >= total_steps:
        return 0.0
    if step <= first_step:
        return float("nan")
    return (end - first_end) / (step - first_step) * (total_steps - step)


def number(x: float) -> float | str:
    """``x`` for a JSON event: NaN and infinities as text (JSON has no such numbers)."""
    return x if math.isfinite(x) else str(x)


def fmt_eta(seconds: float) -> str:
    """H:MM:SS, or ``?`` when unknown (infinite or NaN)."""
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
