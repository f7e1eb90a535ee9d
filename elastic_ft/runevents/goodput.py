"""Goodput: every second of a run's wall time attributed to one category, from its events.

A run is a sequence of attempts (each begins with a ``start`` event: the
leader of a new set of workers). What the leader records for this
(``events.jsonl``): the worker process's start time and, on the first
attempt under torchrun, its agent's (``start``: ``process_start``,
``agent_start``); when training begins (``resume_plan``); every step's end
and duration (``step_done``); the steps saved at (``checkpoint_*``); and
how an attempt ended (its last event, ``end`` or ``preempted`` for a clean
exit). :func:`attribute` walks that timeline once, so the categories
partition the wall time exactly:

- ``kept``: steps whose result the final model holds, with the loop's own
  work between steps;
- ``redone``: steps trained, then lost to a restart that resumed from an
  earlier checkpoint (their number was trained again, or will be);
- ``checkpoint``: training blocked by a save (the boundary after a step that
  was saved, and the final flush or a commit before leaving);
- ``restart``: the agent's first rendezvous, the gap between one attempt's
  last event and the next worker's start (detection, re-rendezvous, process
  start), and a killed attempt's unrecorded tail;
- ``loading``: from a worker's start to its first step (imports, process
  group, model and data, checkpoint read).

Goodput is ``kept / wall``. Only the leader's events are in a run's file, so
on several machines a file covers the attempts whose leader wrote to it; the
run's store has every leader's (:func:`elastic_ft.runevents.load.load_run_events`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

from elastic_ft.handoff import launch
from elastic_ft.runevents.schema import valid

CATEGORIES = ("kept", "redone", "checkpoint", "restart", "loading")
LABELS = {
    "kept": "training (kept)", "redone": "steps redone after a loss", "checkpoint": "checkpoint blocking",
    "restart": "rendezvous and restart", "loading": "loading",
}
_SAVES = ("checkpoint_committed", "checkpoint_failed", "checkpoint_skipped")
_CLEAN_ENDS = ("end", "preempted")


@dataclasses.dataclass(frozen=True)
class Goodput:
    seconds: dict[str, float]
    """Category -> seconds; the values sum to :attr:`wall`."""
    wall: float
    attempts: int

    @property
    def goodput(self) -> float:
        return self.seconds["kept"] / self.wall if self.wall > 0 else 0.0

    def table(self) -> str:
        rows = [f"{'category':<28}{'seconds':>10}{'%':>8}"]
        for c in CATEGORIES:
            share = 100 * self.seconds[c] / self.wall if self.wall > 0 else 0.0
            rows.append(f"{LABELS[c]:<28}{self.seconds[c]:>10.2f}{share:>8.1f}")
        rows.append(f"{'wall':<28}{self.wall:>10.2f}{100.0 if self.wall > 0 else 0.0:>8.1f}")
        rows.append(f"goodput {100 * self.goodput:.1f} % over {self.attempts} attempt(s)")
        return "\n".join(rows)


@dataclasses.dataclass
class _Attempt:
    events: list[dict]

    @property
    def process_start(self) -> float:
        first = self.events[0]
        return float(_field(first, "process_start", first["ts"]))

    @property
    def end(self) -> float:
        return max(float(e["ts"]) for e in self.events)

    def first(self, name: str) -> dict | None:
        return next((e for e in self.events if e["event"] == name), None)


def _field(event: dict, name: str, default: float) -> float:
    """``event[name]``, or ``default`` where it is missing or null (a run before the field, or no /proc)."""
    value = event.get(name)
    return default if value is None else float(value)


def _attempts(events: list[dict]) -> list[_Attempt]:
    """The run's attempts in order; events before the first ``start`` (none in a real run) are ignored."""
    out: list[_Attempt] = []
    for e in events:
        if e.get("event") == "start":
            out.append(_Attempt([e]))
        elif out and "ts" in e:
            out[-1].events.append(e)
    return out


def _redone(attempts: list[_Attempt]) -> set[tuple[int, int]]:
    """(attempt, step) of every step trained and then discarded by a later attempt's resume."""
    trained: list[tuple[int, int]] = []
    lost: set[tuple[int, int]] = set()
    for i, a in enumerate(attempts):
        plan = a.first("resume_plan")
        if plan is not None:
            lost.update((j, s) for j, s in trained if s > int(plan["step"]))
        trained.extend((i, int(e["step"])) for e in a.events if e["event"] == "step_done")
    return lost


class _Clock:
    """Walks the timeline forward, giving each stretch to a category; going back in time adds nothing."""

    def __init__(self, start: float) -> None:
        self.now = start
        self.seconds = {c: 0.0 for c in CATEGORIES}

    def until(self, t: float, category: str) -> None:
        if t > self.now:
            self.seconds[category] += t - self.now
            self.now = t


def _walk(clock: _Clock, i: int, a: _Attempt, lost: set[tuple[int, int]]) -> None:
    """One attempt: the gap before its process, loading, its steps with the boundaries between, its tail."""
    clock.until(a.process_start, "restart")
    plan = a.first("resume_plan")
    clock.until(float(plan["ts"]) if plan else a.end, "loading")
    saved = {int(e["step"]) for e in a.events if e["event"] in _SAVES}
    previous = None
    for e in a.events:
        if e["event"] != "step_done":
            continue
        step, end = int(e["step"]), float(e["ts"])
        kind = "redone" if (i, step) in lost else "kept"
        clock.until(end - float(e["seconds"]), "checkpoint" if previous in saved else kind)
        clock.until(end, kind)
        previous = step
    if a.events[-1]["event"] in _CLEAN_ENDS:
        tail = "checkpoint" if previous in saved else ("redone" if (i, previous) in lost else "kept")
    else:
        tail = "restart"  # killed or lost: what it did after its last event is unknown, and cost a restart
    clock.until(a.end, tail)


def attribute(events: list[dict]) -> Goodput:
    """The run's wall time by category, from its events (all attempts, in file order).

    Wall time runs from the first attempt's agent start (its process start
    when not under torchrun) to the run's last event. Events whose times go
    backwards (rounding, clocks) add nothing, so the categories always sum
    to the wall time. No ``start`` event: zero wall time. Malformed events
    are left out (:mod:`~elastic_ft.runevents.schema`).
    """
    attempts = _attempts(valid(events))
    if not attempts:
        return Goodput({c: 0.0 for c in CATEGORIES}, 0.0, 0)
    first = attempts[0].events[0]
    begin = float(_field(first, "agent_start", attempts[0].process_start))
    clock = _Clock(begin)
    lost = _redone(attempts)
    for i, a in enumerate(attempts):
        _walk(clock, i, a, lost)
    return Goodput(clock.seconds, clock.now - begin, len(attempts))


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall-clock start time of process ``pid`` (to 10 ms) from /proc (Linux), or None where that cannot be read.

    /proc gives the start in clock ticks since boot; its age against the boot
    clock, taken from now, is the start in wall-clock time (``btime`` in
    /proc/stat has whole seconds only).
    """
    ticks = launch.start_ticks(pid)
    if ticks is None:
        return None
    try:
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):  # no boot clock or tick rate: not Linux
        return None
    return round(time.time() - age, 3)


def start_fields() -> dict:
    """What the ``start`` event records for goodput: this process's start, its torchrun agent's (and pid), whether
    the node's warm process forked it (:mod:`elastic_ft.warm`: no imports of its own)."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    # A warm-forked worker started when torchrun started its launcher: that is the restart's cost.
    return {"process_start": process_start_time(launch.worker_pid()),
            "agent_start": process_start_time(launch.agent_pid()) if under_torchrun else None,
            "agent_pid": launch.agent_pid() if under_torchrun else None,
            "warm": launch.forked_warm()}


def find_events(path: str, environ: Mapping[str, str] | None = None) -> str:
    """The events file of ``path``: the file itself, a log directory holding it, a run directory's logs/,
    a run's checkpoint URI (where :func:`~elastic_ft.runevents.events.events_dir` puts its events by default), or
    a run id (its directory under the default ``--checkpoint_uri``, ``runs/``, or under
    :func:`~elastic_ft.runevents.events.local_runs_root`).

    Raises FileNotFoundError naming what was looked for.
    """
    from elastic_ft.runevents.events import events_dir, local_runs_root

    if "://" in path:
        uri = path.rstrip("/")
        parent, _, run_id = uri.rpartition("/")
        path = os.path.dirname(events_dir(parent, run_id, environ=environ))  # the run's directory
    candidates = [path, os.path.join(path, "events.jsonl"), os.path.join(path, "logs", "events.jsonl")]
    if "/" not in path and not os.path.exists(path):  # a run id
        candidates += [os.path.join(root, path, "logs", "events.jsonl") for root in ("runs", local_runs_root(environ))]
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise FileNotFoundError(f"no events.jsonl at {path!r} (looked for {', '.join(candidates[1:])}); name the file, "
                            f"its directory (the spec's logging.dir), the run directory, the run's URI or its id")
