"""What bench/preemption.py derives from a run's records: the parts of a recovery, steps lost, goodput projected.

Only records are read here, no process is touched: the run's events (the
leader's ``events.jsonl``: ``start`` with the worker's ``process_start``,
``resume_plan``, ``step_done``, ``checkpoint_committed``, ``spot_decision``,
``preempted``), the timestamped lines of the survivor's torchrun agent
(``I1201 07:57:32.424000 PID torch/distributed/elastic/agent/server/api.py:553]
[default] Rendezvous complete ...``, local time to the millisecond), and the
wall times the bench acted at. :class:`EventTail` reads a growing events file
incrementally, so the bench's polling costs the training run nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from typing import Iterable

from elastic_ft.runevents.goodput import Goodput

ANNOUNCED = ("notice", "sigterm")
UNANNOUNCED = ("kill", "silent")
LEAVE_ACTIONS = ("checkpoint_and_leave", "flush_and_leave")

# torch's agent lines (its own log format), e.g. "I1201 07:57:32.424000 16238 torch/.../api.py:553] [default] ...".
_AGENT_LINE = re.compile(
    r"^[IWEDC](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+)\s+\d+ torch/distributed/elastic/agent/server/api\.py:\d+\] "
    r"\[[^\]]*\] (.*)$"
)
# The agent decides to restart its workers: they failed (a peer died, or they left on a notice: exit 75),
# or the rendezvous reports a membership change (the etcd3 handler: a member's keep-alive expired).
_RESTARTS = re.compile(r"^(Worker group FAILED|Detected \d+ new nodes)")
_RENDEZVOUSING = re.compile(r"^Rendezvous'ing worker group")
_COMPLETE = re.compile(r"^Rendezvous complete for workers")


class EventTail:
    """The events of a file another process appends to, read from where the last call stopped.

    A line not yet ended by a newline is kept until it is; a line that is not
    JSON (a writer killed mid-line) is skipped, as ``read_events`` does.
    """

    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        self.path = path
        self.events: list[dict] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return self.events


def agent_marks(text: str, year: int) -> list[tuple[float, str]]:
    """(wall time, message) of every timestamped line of torch's agent in a node's log (local time)."""
    out = []
    for line in text.splitlines():
        m = _AGENT_LINE.match(line)
        if m:
            month, day, clock, message = m.groups()
            when = datetime.datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
            out.append((when.timestamp(), message))
    return out


def first_step_after(events: list[dict], t: float, world: int | None = None) -> tuple[int, int] | None:
    """(index of the ``start``, index of its first ``step_done``) of the first attempt started after wall
    time ``t`` (at world ``world`` when given) that trained a step; None while there is none.

    An attempt that started but never trained (a round interrupted by another
    change) is passed over: the one whose step came first is the new world.
    A ``carried`` step (a lost leader's step, written again by the new leader
    at a resume from a node's kept step) is not one the new world trained.
    """
    start = None
    for i, e in enumerate(events):
        if e["event"] == "start":
            start = i if e["ts"] > t and (world is None or e["world"] == world) else None
        elif e["event"] == "step_done" and start is not None and not e.get("carried"):
            return start, i
    return None


@dataclasses.dataclass
class Recovery:
    """One preemption: from the event (``t0``, the bench's clock) to the first step of the new world."""

    kind: str
    parts: list[tuple[str, float | None]]
    """(part, seconds) in order; None where the record that ends it was not found."""
    total: float
    worlds: tuple[int, int]
    """World size before and after."""
    lost: int
    """Steps trained before the event and trained again after the resume."""
    since_commit: int
    """Steps trained since the newest committed checkpoint, at the event."""
    detect: float | None
    """Event -> the survivor's agent decides to restart its workers (for a silent node: the keep-alive check)."""


def _chain(t0: float, marks: list[tuple[str, float | None]]) -> list[tuple[str, float | None]]:
    """Consecutive differences of the times in ``marks`` from ``t0``; a missing time leaves its part None."""
    out, previous = [], t0
    for name, t in marks:
        out.append((name, None if t is None else t - previous))
        previous = previous if t is None else t
    return out


def _first(marks: list[tuple[float, str]], after: float | None, pattern: re.Pattern) -> float | None:
    """The time of the first mark at or after ``after`` whose message matches ``pattern``."""
    if after is None:
        return None
    return next((t for t, m in marks if t >= after and pattern.match(m)), None)


def recovery(kind: str, t0: float, events: list[dict], marks: list[tuple[float, str]]) -> Recovery:
    """The recovery from an event of ``kind`` at ``t0``, from the run's events and the agent marks of the
    node that holds the new world's leader.

    Raises ValueError when the events hold no trained attempt after ``t0``.
    """
    found = first_step_after(events, t0)
    if found is None:
        raise ValueError(f"no attempt started after the {kind} at {t0:.3f} trained a step")
    i_start, i_step = found
    start, step = events[i_start], events[i_step]
    plan = next((e for e in events[i_start:i_step] if e["event"] == "resume_plan"), None)
    before = events[:i_start]
    trained = max((e["step"] for e in before if e["event"] == "step_done"), default=0)
    committed = max((e["step"] for e in before if e["event"] == "checkpoint_committed"), default=0)
    world_before = next((e["world"] for e in reversed(before) if e["event"] == "start"), 0)
    resumed = plan["step"] if plan else 0
    process = start.get("process_start") or start["ts"]

    restart = _first(marks, t0, _RESTARTS)
    rendezvousing = _first(marks, restart, _RENDEZVOUSING)
    # The round the new workers came from: the last one completed before they started.
    complete = max((t for t, m in marks if _COMPLETE.match(m) and t <= process + 0.05
                    and rendezvousing is not None and t >= rendezvousing), default=None)
    if kind in ANNOUNCED:
        decision = next((e["ts"] for e in before if e["event"] == "spot_decision" and e["ts"] >= t0
                         and e["action"] in LEAVE_ACTIONS), None)
        left = next((e["ts"] for e in before if e["event"] == "preempted" and e["ts"] >= t0), None)
        head = [("notice seen, ranks agree", decision), ("commit (synchronous)", left),
                ("workers exit, agent restarts them", restart)]
    else:
        head = [("detect (agent restarts workers)", restart)]
    tail = [("stop workers", rendezvousing), ("re-rendezvous", complete), ("worker spawn", process),
            ("worker init (imports, model, process group)", start["ts"]),
            ("resume: kept step or checkpoint, plan", plan and plan["ts"]),
            ("first step", step["ts"])]
    return Recovery(kind=kind, parts=_chain(t0, head + tail), total=step["ts"] - t0,
                    worlds=(world_before, start["world"]), lost=max(0, trained - resumed),
                    since_commit=max(0, trained - committed), detect=None if restart is None else restart - t0)


@dataclasses.dataclass
class Join:
    """A node coming back: the survivors commit, stop, and the full world trains again."""

    pause: float
    """The last step before the full world's start -> its first step."""
    lost: int


def join(events: list[dict], t: float, world: int) -> Join | None:
    """The rejoin after wall time ``t`` at ``world``, or None when the full world never trained."""
    found = first_step_after(events, t, world)
    if found is None:
        return None
    i_start, i_step = found
    before = events[:i_start]
    last = next((e for e in reversed(before) if e["event"] == "step_done"), None)
    plan = next((e for e in events[i_start:i_step] if e["event"] == "resume_plan"), None)
    trained = last["step"] if last else 0
    return Join(pause=events[i_step]["ts"] - (last["ts"] if last else t),
                lost=max(0, trained - (plan["step"] if plan else 0)))


@dataclasses.dataclass(frozen=True)
class Projection:
    cost_s: float
    """Seconds of wall time one preemption costs (with the node's return), beyond a run without any."""
    checkpoint_ratio: float
    """Checkpoint blocking per second of kept training, in the run without preemptions."""

    def goodput(self, every_s: float) -> float:
        """A long run with one preemption every ``every_s`` seconds: ``(1 - c / T) / (1 + r0)``."""
        return max(0.0, 1.0 - self.cost_s / every_s) / (1.0 + self.checkpoint_ratio)


def project(with_: Goodput, without: Goodput, preemptions: int) -> Projection:
    """The cost per preemption, measured: what the run with preemptions lost beyond the run without.

    ``c = (W - K - S0 - r0 * K) / n``: W and K the wall and kept seconds of
    the run with ``n`` preemptions, S0 the one-time start of the run without
    (its restart and loading seconds: the agents' first rendezvous, worker
    start), r0 its checkpoint blocking per kept second (the saves any run
    makes). What remains is redone steps, restarts, loading and the commits
    on notices, of the preemptions and of the nodes' returns.
    """
    r0 = without.seconds["checkpoint"] / without.seconds["kept"] if without.seconds["kept"] > 0 else 0.0
    start0 = without.seconds["restart"] + without.seconds["loading"]
    kept = with_.seconds["kept"]
    overhead = with_.wall - kept - start0 - r0 * kept
    return Projection(cost_s=overhead / max(1, preemptions), checkpoint_ratio=r0)


def table(rows: Iterable[list[str]], align: str) -> str:
    """Rows as fixed-width columns; ``align`` holds '<' or '>' per column."""
    rows = list(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(align))]
    return "\n".join("  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)).rstrip() for r in rows)
