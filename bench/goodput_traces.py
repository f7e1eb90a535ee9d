"""Node availability traces for the goodput model: a CSV of ``ms,add|remove,node``, or synthetic ones.

A trace is a time-ordered list of :class:`NodeEvent`. A removal may carry a
spot notice (``notice_s`` seconds before it; 0: none). The CSV format has no
notices (the Parcae p3 trace records reclaims only): the reader gives every
removal the same ``notice_s``.

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
import math
import random

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


def read_csv(path: str, notice_s: float = 0.0) -> list[NodeEvent]:
    """The events of the CSV at ``path`` (``ms,add|remove,node`` a line), time-ordered; raises :class:`TraceError`."""
    out: list[NodeEvent] = []
    try:
        with open(path, newline="") as f:
            for n, row in enumerate(csv.reader(f), start=1):
                if not row or (n == 1 and not row[0].strip().lstrip("-").isdigit()):
                    continue  # blank line, or a header
                out.append(_event(row, notice_s, f"{path}:{n}"))
    except OSError as exc:
        raise TraceError(f"--trace: cannot read {path!r}: {exc.strerror}") from None
    if not out:
        raise TraceError(f"--trace: {path!r} holds no event (expected lines of ms,add|remove,node)")
    return sorted(out, key=lambda e: (e.t, e.kind != "remove"))  # removals first at one instant


def _event(row: list[str], notice_s: float, where: str) -> NodeEvent:
    if len(row) != 3:
        raise TraceError(f"--trace {where}: expected ms,add|remove,node, got {','.join(row)!r}")
    ms, kind, node = (c.strip() for c in row)
    try:
        t = int(ms) / 1000.0
    except ValueError:
        raise TraceError(f"--trace {where}: {ms!r} is not whole milliseconds") from None
    if t < 0 or kind not in ("add", "remove") or not node:
        raise TraceError(f"--trace {where}: need ms >= 0, add or remove, and a node id; got {','.join(row)!r}")
    return NodeEvent(t, kind, node, notice_s if kind == "remove" else 0.0)


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
