"""Node availability traces for the goodput model: a CSV of ``ms,add|remove,node``, or synthetic ones.

A trace is a time-ordered list of :class:`NodeEvent`. A removal may carry a
spot notice (``notice_s`` seconds before it; 0: none). The CSV format has no
notices (the Parcae p3 trace records reclaims only): the reader gives every
removal the same ``notice_s``. :func:`parse_text` is the format's one parser
(bench/trace_segments.py reads the replay's traces through it too); a bad
line is one :class:`TraceError` naming the file and the line.

Synthetic traces follow the AWS Spot Instance Advisor's "frequency of
interruption" buckets (the share of a type's instances interrupted in a
month): each node's lifetime is exponential with the hazard of its bucket's
representative share ``p`` (``-ln(1 - p)`` per 30 days), and a reclaimed node
is replaced by a new one after ``replace_s`` (a Spot request refilled). The
trace is a pure function of its arguments and the seed.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import random
import re

MONTH_S = 30 * 86_400.0
BUCKETS = {"<5%": 0.025, "5-10%": 0.075, "10-15%": 0.125, "15-20%": 0.175, ">20%": 0.25}
"""Spot Advisor bucket -> the monthly interruption share taken for it (the middle; 25 % assumed for >20 %)."""


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file, the line and what to do."""


@dataclasses.dataclass(frozen=True, order=True)
class NodeEvent:
    t: float
    """Seconds since the trace began."""
    kind: str
    """``add`` or ``remove``."""
    node: str
    notice_s: float = 0.0
    """A removal's spot notice: given this many seconds before ``t`` (0: unannounced)."""


MAX_MS = 10 * 365 * 86_400_000
"""The latest time a trace line may give (ten years): bounded, and a time below it survives ms -> s -> ms exactly."""


def read_text(path: str) -> str:
    """The text of the trace file at ``path``; raises :class:`TraceError` naming it (``--trace``, the flag that
    gives it in both benches) when it cannot be read or is not UTF-8."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a BOM would hide line 1 as a header
            return f.read()
    except OSError as exc:
        raise TraceError(f"--trace: cannot read {path!r} ({exc.strerror}); give the path of a CSV "
                         f"'ms,add|remove,node'") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"--trace: cannot read {path!r}: byte {exc.start} is not UTF-8; give a CSV "
                         f"'ms,add|remove,node'") from None


def parse_text(text: str, source: str = "trace", notice_s: float = 0.0) -> list[NodeEvent]:
    """The events of a trace CSV's text (``ms,add|remove,node`` a line), in the file's order: the one parser of
    the format (bench/goodput_model.py and bench/trace_replay.py both read through it). A first line whose
    first field is not a number is a header; blank lines are skipped. Every removal gets ``notice_s`` (the
    format has none). Raises :class:`TraceError`, one line naming ``source`` and the line, for anything else.
    """
    out: list[NodeEvent] = []
    rows = csv.reader(io.StringIO(text, newline=""))
    try:
        for n, row in enumerate(rows, start=1):
            if len(row) <= 1 and not "".join(row).strip():
                continue  # a blank line
            if n == 1 and not re.fullmatch(r"[-+]?[0-9]+(\.[0-9]*)?", row[0].strip()):
                continue  # a header (a number there is a line of data, checked as one: "-5" is not skipped)
            out.append(_event(row, notice_s, f"{source}:{n}"))
    except csv.Error as exc:
        raise TraceError(f"{source}:{rows.line_num}: not a CSV line ({exc}); give lines of 'ms,add|remove,node'") \
            from None
    if not out:
        raise TraceError(f"{source}: holds no event; give lines of 'ms,add|remove,node'")
    return out


def read_csv(path: str, notice_s: float = 0.0) -> list[NodeEvent]:
    """The events of the CSV at ``path`` (see :func:`parse_text`), time-ordered, removals first at one instant;
    raises :class:`TraceError`."""
    events = parse_text(read_text(path), f"--trace {path}", notice_s)
    return sorted(events, key=lambda e: (e.t, e.kind != "remove"))


def _event(row: list[str], notice_s: float, where: str) -> NodeEvent:
    if len(row) != 3:
        raise TraceError(f"{where}: expected 'ms,add|remove,node', got {','.join(row)!r}")
    ms, kind, node = (c.strip() for c in row)
    # ASCII digits only: int() would also take "+5", "1_000" and other scripts' digits.
    if not re.fullmatch(r"[0-9]+", ms):
        raise TraceError(f"{where}: the time {ms!r} is not a whole number of milliseconds")
    if int(ms) > MAX_MS:
        raise TraceError(f"{where}: the time {ms} ms is beyond ten years; give milliseconds since the trace began")
    if kind not in ("add", "remove"):
        raise TraceError(f"{where}: the action {kind!r} is not 'add' or 'remove'")
    if not node:
        raise TraceError(f"{where}: the node is empty; name the node the line adds or removes")
    return NodeEvent(int(ms) / 1000.0, kind, node, notice_s if kind == "remove" else 0.0)


def synthetic(*, nodes: int, monthly_share: float, hours: float, seed: int, replace_s: float = 300.0,
              notice_s: float = 0.0) -> list[NodeEvent]:
    """``nodes`` nodes at t=0, each reclaimed at the hazard of ``monthly_share`` and replaced ``replace_s`` later.

    Cost: one draw per node lifetime, O(events log events).
    """
    if not 0 < monthly_share < 1:
        raise ValueError(f"monthly_share must be between 0 and 1, got {monthly_share}")
    rate = -math.log(1.0 - monthly_share) / MONTH_S
    rng, end = random.Random(seed), hours * 3600.0
    out: list[NodeEvent] = []
    serial = 0
    for slot in range(nodes):
        t = 0.0
        while t < end:
            serial += 1
            name = f"n{slot}-{serial}"
            out.append(NodeEvent(t, "add", name))
            gone = t + rng.expovariate(rate)
            if gone >= end:
                break
            out.append(NodeEvent(gone, "remove", name, notice_s))
            t = gone + replace_s
    return sorted(out, key=lambda e: (e.t, e.kind != "remove", e.node))


def periodic(*, nodes: int, every_s: float, hours: float, back_after_s: float, notices: list[float]) -> list[NodeEvent]:
    """``nodes`` nodes; every ``every_s`` (first at half of it) one is removed in turn and back ``back_after_s``
    later; the k-th removal's notice is ``notices[k % len(notices)]`` (bench/preemption.py's schedule)."""
    out = [NodeEvent(0.0, "add", f"n{i}") for i in range(nodes)]
    t, k = every_s / 2, 0
    while t < hours * 3600.0:
        name = f"n{k % nodes}"
        out.append(NodeEvent(t, "remove", name, notices[k % len(notices)]))
        out.append(NodeEvent(t + back_after_s, "add", name))
        t, k = t + every_s, k + 1
    return sorted(out, key=lambda e: (e.t, e.kind != "remove", e.node))


def peak(events: list[NodeEvent]) -> int:
    """The most nodes up at once."""
    up: set[str] = set()
    most = 0
    for e in events:
        (up.add if e.kind == "add" else up.discard)(e.node)
        most = max(most, len(up))
    return most


def duration(events: list[NodeEvent]) -> float:
    return max((e.t for e in events), default=0.0)
