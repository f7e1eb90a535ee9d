"""A run's events as the series and marks of its plot: a pure function, tested without matplotlib.

Against the step: the loss and learning rate of the try of each step the run
kept (the last one, not lost to a restart), and apart from it the tries that
were trained and then lost (a restart resumed from an earlier checkpoint, so
the step was, or will be, trained again). Against wall time (seconds since the
run began): throughput and world size, one segment per attempt, so the gap of
a restart shows as a gap. Marks: checkpoints committed, preemptions (a spot
notice the job left on, ``preempted``; a node lost without notice,
``node_lost``), rescales, and the start of each attempt after the first.

Events are grouped by the ``attempt`` each carries (counted from the ``start``
events for a file written before that field), as :mod:`elastic_ft.runevents.goodput`
reads them.
"""

from __future__ import annotations

import dataclasses
import math

from elastic_ft.runevents.schema import valid
from elastic_ft.runevents.status import kept_evals

MARK_KINDS = ("checkpoint", "preempted", "node_lost", "rescale", "restart")


@dataclasses.dataclass(frozen=True)
class Mark:
    kind: str
    """One of :data:`MARK_KINDS`."""
    step: float
    """Where on the step axis."""
    t: float
    """Where on the time axis: seconds since the run began."""
    text: str


@dataclasses.dataclass(frozen=True)
class Segment:
    """One attempt's steps against wall time."""

    attempt: int
    t: list[float]
    tokens_per_s: list[float]
    world: list[int]


@dataclasses.dataclass(frozen=True)
class RunSeries:
    run_id: str | None
    total_steps: int | None
    attempts: int
    t0: float
    """Epoch seconds the run began (the first attempt's agent or process start): time 0 of the time axis."""
    step: list[int]
    """The steps trained, ascending; ``loss`` and ``lr`` are those of the try the run kept."""
    loss: list[float]
    lr: list[float]
    redone_step: list[int]
    """Steps of tries lost to a restart (each is, or will be, trained again); ``redone_loss`` their losses."""
    redone_loss: list[float]
    segments: list[Segment]
    marks: list[Mark]
    eval_step: list[int] = dataclasses.field(default_factory=list)
    """Evaluated steps, ascending; ``eval_loss`` their held-out loss (the last evaluation of each step)."""
    eval_loss: list[float] = dataclasses.field(default_factory=list)

    def loss_at(self, step: float) -> float | None:
        """The kept loss of ``step``, or None where no step event has it (a checkpoint at step 0)."""
        try:
            return self.loss[self.step.index(int(step))]
        except ValueError:
            return None


def _num(value, default: float = math.nan) -> float:
    """A float from an event field; NaN for a missing one or one written as text ("nan")."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def by_attempt(events: list[dict]) -> list[list[dict]]:
    """The events of each attempt, attempts in order (its ``attempt`` field, else the ``start`` events counted)."""
    groups: dict[int, list[dict]] = {}
    counted = 0
    for e in events:
        if e.get("event") == "start":
            counted += 1
        groups.setdefault(int(e.get("attempt") or counted), []).append(e)
    return [groups[k] for k in sorted(groups)]


def _origin(events: list[dict]) -> float:
    start = next((e for e in events if e.get("event") == "start"), None)
    if start is None:
        return min((_num(e.get("ts")) for e in events), default=0.0)
    for field in ("agent_start", "process_start", "ts"):
        if start.get(field) is not None:
            return _num(start[field])
    return 0.0


def _tries(attempts: list[list[dict]]) -> tuple[list[tuple[int, dict]], set[int]]:
    """Every step event with its attempt's index, and the indexes into that list of tries lost to a restart."""
    tries: list[tuple[int, dict]] = []
    lost: set[int] = set()
    for i, events in enumerate(attempts):
        plan = next((e for e in events if e.get("event") == "resume_plan"), None)
        if plan is not None:
            lost.update(k for k, (_, e) in enumerate(tries) if int(e["step"]) > int(plan["step"]))
        tries.extend((i, e) for e in events if e.get("event") == "step" and "step" in e)
    return tries, lost


def _step_series(tries: list[tuple[int, dict]], lost: set[int]) -> tuple[dict[int, dict], list[dict]]:
    """(step -> the kept try, the other tries): the last try of a step not lost is the kept one."""
    kept: dict[int, dict] = {}
    others: list[dict] = []
    for k, (_, e) in enumerate(tries):
        step = int(e["step"])
        if k in lost:
            others.append(e)
            continue
        if step in kept:
            others.append(kept[step])
        kept[step] = e
    return kept, others


def _segments(attempts: list[list[dict]], t0: float) -> list[Segment]:
    out = []
    for i, events in enumerate(attempts):
        steps = [e for e in events if e.get("event") == "step"]
        if not steps:
            continue
        attempt = int(events[0].get("attempt") or i + 1)
        out.append(Segment(
            attempt=attempt,
            t=[_num(e.get("t_end"), _num(e.get("ts"))) - t0 for e in steps],
            tokens_per_s=[_num(e.get("tokens_per_s")) for e in steps],
            world=[int(e.get("world") or 0) for e in steps],
        ))
    return out


def _last_step(events: list[dict]) -> float:
    return max((_num(e.get("step"), 0.0) for e in events if e.get("event") in ("step", "step_done")), default=0.0)


def _marks(attempts: list[list[dict]], t0: float) -> list[Mark]:
    marks: list[Mark] = []
    for i, events in enumerate(attempts):
        for e in events:
            name, t = e.get("event"), _num(e.get("ts")) - t0
            if name == "checkpoint_committed":
                marks.append(Mark("checkpoint", _num(e.get("step")), t, f"checkpoint at step {e.get('step')}"))
            elif name == "preempted":
                marks.append(Mark("preempted", _num(e.get("step")), t,
                                  f"preempted at step {e.get('step')} ({e.get('notice')} notice)"))
            elif name == "node_lost" and i > 0:
                # The loss happened where the previous attempt stopped, not where this one says so.
                before = attempts[i - 1]
                marks.append(Mark("node_lost", _last_step(before), _num(before[-1].get("ts")) - t0,
                                  f"node lost: {e.get('reason')}"))
            elif name == "rescale":
                changed = ", ".join(f"{k} {v.get('old')}->{v.get('new')}" for k, v in (e.get("changed") or {}).items())
                marks.append(Mark("rescale", _num(e.get("step")), t, f"rescale at step {e.get('step')}: {changed}"))
            elif name == "start" and i > 0:
                plan = next((p for p in events if p.get("event") == "resume_plan"), {})
                marks.append(Mark("restart", _num(plan.get("step"), 0.0), t,
                                  f"attempt {e.get('attempt', i + 1)} starts (resumes after step {plan.get('step')})"))
    return marks


def run_series(events: list[dict]) -> RunSeries:
    """What the plot of a run draws, from its events in file order (all attempts); malformed events are left
    out (:mod:`~elastic_ft.runevents.schema`)."""
    events = valid(events)
    attempts = by_attempt(events)
    t0 = _origin(events)
    tries, lost = _tries(attempts)
    kept, others = _step_series(tries, lost)
    steps = sorted(kept)
    others.sort(key=lambda e: (int(e["step"]), int(e.get("attempt") or 0)))
    starts = [e for e in events if e.get("event") == "start"] or [{}]
    evals = kept_evals(events)
    return RunSeries(
        run_id=starts[0].get("run_id"), total_steps=starts[-1].get("total_steps"),  # a restart may extend a run
        attempts=sum(1 for e in starts if e), t0=t0,
        step=steps, loss=[_num(kept[s].get("loss")) for s in steps], lr=[_num(kept[s].get("lr")) for s in steps],
        redone_step=[int(e["step"]) for e in others], redone_loss=[_num(e.get("loss")) for e in others],
        segments=_segments(attempts, t0), marks=_marks(attempts, t0),
        eval_step=list(evals), eval_loss=[_num(e.get("loss")) for e in evals.values()],
    )
