"""A run at a glance (``elastic-ft status``): a pure summary of its events and checkpoints.

Inputs in, lines out, the clock passed in: :func:`summary` is what the command
prints, from the run's merged events (every attempt's), its committed
checkpoints and, where the rendezvous was asked, its current world.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

from elastic_ft.runevents.attempt_history import CLEAN_EXITS
from elastic_ft.runevents.goodput import CATEGORIES, LABELS, attribute
from elastic_ft.runevents.merge import latest_steps
from elastic_ft.runevents.schema import valid



@dataclasses.dataclass(frozen=True)
class Checkpoint:
    step: int
    created: float
    """When its manifest was written (epoch seconds)."""


@dataclasses.dataclass(frozen=True)
class LiveWorld:
    """The newest rendezvous round of the run, as the agents left it in etcd."""

    round: int
    world: int
    """Workers (ranks) of the round."""
    nodes: int


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else (
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _progress(events: list[dict], kept: list[dict]) -> list[str]:
    starts = [e for e in events if e.get("event") == "start"]
    total = starts[-1].get("total_steps") if starts else None
    done = max((e["step"] for e in kept if e.get("event") in ("step", "step_done", "step_skipped")), default=0)
    share = f" ({100 * done / total:.1f} %)" if isinstance(total, int) and total > 0 else ""
    last = events[-1] if events else {}
    state = {"end": "finished", "preempted": "left on a preemption notice", "aborted": "aborted"}.get(
        last.get("event"), "running, or stopped without a clean exit")
    return [f"steps: {done} of {total if total is not None else '?'}{share}; {state} "
            f"(last event {last.get('event')!r} at {_when(float(last['ts'])) if 'ts' in last else '?'})"]


def _checkpoint(newest: Checkpoint | None, committed: int, now: float) -> list[str]:
    if newest is None:
        return ["last checkpoint: none committed"]
    return [f"last checkpoint: step {newest.step}, committed {_ago(now - newest.created)} ago ({_when(newest.created)}); "
            f"{committed} committed"]


def _world(events: list[dict], live: LiveWorld | None, asked: bool) -> list[str]:
    if live is not None:
        return [f"world: {live.world} rank(s) on {live.nodes} node(s) (rendezvous round {live.round}, from etcd)"]
    sized = [e for e in events if isinstance(e.get("world"), int)]
    seen = f"{sized[-1]['world']} rank(s), from the last events" if sized else "unknown"
    return [f"world: {seen}" + ("; the rendezvous has no live round" if asked else "")]


def _interruptions(events: list[dict]) -> list[str]:
    counts = {name: [e for e in events if e.get("event") == name] for name in ("rescale", "preempted", "node_lost")}
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    # An attempt whose last event is not a clean exit and that another attempt followed was killed or lost.
    cut = sum(1 for i, j in zip(starts, starts[1:]) if events[j - 1].get("event") not in CLEAN_EXITS)
    # A SIGTERM may be a stop or torchrun restarting the workers for a node that joins: not always a preemption.
    sigterm = sum(1 for e in counts["preempted"] if e.get("notice") == "sigterm")
    lines = [f"attempts: {len(starts)}; rescales: {len(counts['rescale'])}; preemptions: "
             f"{len(counts['preempted']) - sigterm} (and {sigterm} exit(s) on SIGTERM); nodes lost: "
             f"{len(counts['node_lost'])}; attempts cut short: {cut}"]
    for e in counts["preempted"][-3:]:
        lines.append(f"  left at step {e.get('step')} on a {e.get('notice')} notice (attempt {e.get('attempt')}), "
                     f"state committed")
    for e in counts["node_lost"][-3:]:
        lines.append(f"  node lost: {e.get('reason')}; resumed after step {e.get('resume_after_step')} at world "
                     f"{e.get('world')} (attempt {e.get('attempt')})")
    return lines


def _goodput(events: list[dict]) -> list[str]:
    g = attribute(events)
    if not g.attempts or g.wall <= 0:
        return ["goodput: no start event yet"]
    return [f"goodput: {100 * g.goodput:.1f} % of {g.wall:.1f} s wall", *(
        f"  {LABELS[c]:<28}{g.seconds[c]:>9.1f} s{100 * g.seconds[c] / g.wall:>7.1f} %" for c in CATEGORIES)]


def _speed(kept: list[dict], now: float, finished: bool) -> list[str]:
    steps = [e for e in kept if e.get("event") == "step"]
    if not steps:
        return ["tokens/s: no step reported yet; ETA: unknown"]
    recent = [e["tokens_per_s"] for e in steps[-20:] if isinstance(e.get("tokens_per_s"), (int, float))]
    rate = f"{sum(recent) / len(recent):,.0f} (mean of the last {len(recent)} steps)" if recent else "?"
    last = steps[-1]
    eta = last.get("eta_s")
    if finished:
        when = "ETA: done"
    elif isinstance(eta, (int, float)) and math.isfinite(eta):
        t = float(last.get("t_end") or last["ts"])
        when = f"ETA: {_ago(eta)} as of step {last['step']} ({_ago(now - t)} ago)"
    else:
        when = "ETA: unknown yet"
    return [f"tokens/s: {rate}; {when}"]


def kept_evals(events: list[dict]) -> dict[int, dict]:
    """Step -> the ``eval`` event the run kept for it: the last one (an evaluation redone after a restart
    supersedes the earlier try, which evaluated weights the run then trained again)."""
    out: dict[int, dict] = {}
    for e in valid(events):
        if e.get("event") == "eval":
            out[int(e["step"])] = e
    return dict(sorted(out.items()))


def _evals(events: list[dict]) -> list[str]:
    kept = kept_evals(events)
    if not kept:
        return []
    def loss(e: dict) -> float:
        try:
            return float(e["loss"])
        except (TypeError, ValueError):
            return math.nan
    step, last = next(reversed(kept.items()))
    finite = {s: loss(e) for s, e in kept.items() if math.isfinite(loss(e))}
    best = f"; lowest {min(finite.values()):.4f} at step {min(finite, key=finite.get)}" if finite else ""
    return [f"eval loss: {loss(last):.4f} at step {step} ({last.get('tokens')} tokens); {len(kept)} evaluation(s)"
            f"{best}"]


def _padding(kept: list[dict]) -> list[str]:
    """Padding waste over the steps kept (each step once, from the attempt that trained it last): the token
    positions the micro-batches computed per token of the samples, from the step events' counts."""
    counted = [e for e in kept if e.get("event") == "step" and isinstance(e.get("real_tokens"), int)
               and isinstance(e.get("computed_tokens"), int)]
    real = sum(e["real_tokens"] for e in counted)
    computed = sum(e["computed_tokens"] for e in counted)
    if not counted or real <= 0:
        return ["padding: no step reported its tokens yet"]
    waste = 100 * (computed - real) / computed if computed > 0 else 0.0
    return [f"padding: {computed / real:.3f} tokens computed per real token ({waste:.1f} % of the computed "
            f"tokens are padding; {real:,} real, {computed:,} computed over {len(counted)} steps)"]


def summary(run: str, events: list[dict], newest: Checkpoint | None, *, committed: int, now: float,
            live: LiveWorld | None = None, asked_rendezvous: bool = False) -> list[str]:
    """The lines of ``elastic-ft status``: progress, last checkpoint, world, interruptions, goodput, speed,
    padding.

    Malformed events are left out (:mod:`~elastic_ft.runevents.schema`); the command reports their count."""
    events = valid(events)
    kept = latest_steps(events)
    finished = bool(events) and events[-1].get("event") == "end"
    return [f"run {run}", *_progress(events, kept), *_checkpoint(newest, committed, now),
            *_world(events, live, asked_rendezvous), *_interruptions(events), *_goodput(events),
            *_speed(kept, now, finished), *_padding(kept), *_evals(events)]
