"""Trace segments for the replay: a node availability trace folded onto a few nodes, compressed, a window chosen.

The pure part of bench/trace_replay.py (no process, no clock): a trace is read
through the format's one parser (:func:`bench.goodput_traces.parse_text`) into
:class:`Change` rows at whole milliseconds (fold and compress work on exact
times), then cut and folded here; bench/trace_replay.py plays the result on the
chaos cluster.

Folding (``fold``): the trace's node ``nodeN`` is cluster node ``(N - 1) mod
K``; a remove takes that node down if it is up, an add brings it up if it is
down, and every other event is merged away (an add to a node that is up, a
remove of one that is down). The fleet's rate of changes is kept (on the
p3 trace at 32 nodes nearly every change is a restart of the whole job, as it
is on K nodes), not its size. Nodes up at the segment's start are ``add``
events at 0 ms. Compression (``compress``): every time divided by one factor,
at most ``--factor`` (6: a trace minute in 10 s) and less where the start the
calibration measured needs it (``fitting_factor``: the first change comes after
the run has started and trained a few steps; on a loaded machine the start
takes a minute or more). The bench's default segment (``busiest_start``) is
the window of ``--minutes`` with the most changes, none in its first six
minutes and some node always up.

Cost: ``fold`` is O(events x slots) (a pass per slot finds the nodes up at the
segment's start); ``busiest_start`` folds once per candidate start (a trace
minute apart): O(minutes x events x slots).
"""

from __future__ import annotations

import dataclasses

from bench.goodput_traces import NodeEvent, TraceError, parse_text, read_text


@dataclasses.dataclass(frozen=True)
class Change:
    ms: int
    action: str
    node: str


def _changes(events: list[NodeEvent]) -> list[Change]:
    """The parser's events as changes at whole ms (exact: the parser bounds ms so that ms -> s -> ms round-trips),
    in time order, stable: changes at the same ms keep the file's order (``fold`` merges by it)."""
    return sorted((Change(round(e.t * 1000), e.kind, e.node) for e in events), key=lambda c: c.ms)


def parse_trace(text: str, source: str = "trace") -> list[Change]:
    """The changes of a trace CSV's text (see :func:`bench.goodput_traces.parse_text`: a header line and blank
    lines skipped), in time order. Raises TraceError naming ``source`` and the line."""
    return _changes(parse_text(text, source))


def read_trace(path: str) -> list[Change]:
    """The changes of the trace CSV at ``path`` (the ``--trace`` flag's), in time order; raises TraceError."""
    return _changes(parse_text(read_text(path), f"--trace {path}"))


def to_csv(changes: list[Change]) -> str:
    return "".join(f"{c.ms},{c.action},{c.node}\n" for c in changes)


def slot_of(node: str, slots: int) -> int:
    """The cluster node a trace node folds onto: ``nodeN`` -> (N - 1) mod ``slots`` (any other name: by its
    digits, else by a stable hash of the name)."""
    digits = "".join(ch for ch in node if ch.isdigit())
    number = int(digits) - 1 if digits else sum(node.encode())
    return number % slots


def fold(changes: list[Change], slots: int, start_ms: int = 0, end_ms: int | None = None) -> list[Change]:
    """The segment [start_ms, end_ms) of a fleet's trace, folded onto ``slots`` nodes named node0.. (see the
    module's docstring), times from the segment's start; the nodes up at its start are adds at 0 ms."""
    up = [False] * slots
    out: list[Change] = []
    for c in changes:
        if end_ms is not None and c.ms >= end_ms:
            break
        s = slot_of(c.node, slots)
        if up[s] == (c.action == "add"):
            continue  # merged: the folded node is already in that state
        up[s] = c.action == "add"
        if c.ms >= start_ms:
            out.append(Change(c.ms - start_ms, c.action, f"node{s}"))
    initial = [Change(0, "add", f"node{s}") for s in range(slots) if _up_at(changes, slots, s, start_ms)]
    return initial + out


def _up_at(changes: list[Change], slots: int, slot: int, ms: int) -> bool:
    """Whether folded node ``slot`` is up just before ``ms`` (a change at ``ms`` itself is the segment's)."""
    up = [False] * slots
    for c in changes:
        if c.ms >= ms:
            break
        s = slot_of(c.node, slots)
        up[s] = c.action == "add"
    return up[slot]


def compress(changes: list[Change], factor: float) -> list[Change]:
    """Every time divided by ``factor`` (> 0), to the millisecond."""
    if not factor > 0:
        raise TraceError(f"--factor: {factor} is not a positive number")
    return [dataclasses.replace(c, ms=round(c.ms / factor)) for c in changes]


def busiest_start(changes: list[Change], slots: int, length_ms: int, lead_ms: int = 180_000,
                  step_ms: int = 60_000) -> int:
    """The start (a multiple of ``step_ms``) of the window of ``length_ms`` whose folded segment holds the most
    changes (a removal counting twice) not in its last ``lead_ms``, none in its first ``lead_ms`` (the run
    starts first), and never every node down (a stalled job measures nothing): the segment the bench plays by
    default. Raises TraceError when there is none."""
    end = max((c.ms for c in changes), default=0)
    best, best_start = 0, None
    for start in range(0, end + 1, step_ms):
        seg = fold(changes, slots, start, start + length_ms)
        initial = sum(1 for s in range(slots) if _up_at(changes, slots, s, start))
        later = seg[initial:]
        if not initial or not later or later[0].ms < lead_ms or not _never_empty(seg):
            continue
        # Changes whose cost the window holds (not those in its last lead_ms), removals first.
        score = sum(2 if c.action == "remove" else 1 for c in later if c.ms <= length_ms - lead_ms)
        if score > best:
            best, best_start = score, start
    if best_start is None:
        raise TraceError(f"no window of {length_ms / 60_000:g} trace minutes with a removal and a node always up "
                         f"folded onto {slots} nodes; give --start-min, or a longer --minutes")
    return best_start


def _never_empty(segment: list[Change]) -> bool:
    """Whether some node is up after every instant's changes (from the first add on)."""
    up: set[str] = set()
    for i, c in enumerate(segment):
        (up.add if c.action == "add" else up.discard)(c.node)
        last_at_instant = i + 1 == len(segment) or segment[i + 1].ms != c.ms
        if last_at_instant and not up:
            return False
    return True


def synthetic_segment() -> str:
    """The test's segment, in the trace's CSV format at trace time (minutes, as the p3 trace): three nodes from
    the start, one reclaimed, back two minutes later, then the node of two workers reclaimed. Compressed by 6
    it runs 100 s."""
    rows = [(0, "add", "node1"), (0, "add", "node2"), (0, "add", "node3"),
            (240_000, "remove", "node3"), (360_000, "add", "node3"), (480_000, "remove", "node2")]
    return "".join(f"{ms},{a},{n}\n" for ms, a, n in rows)


SYNTHETIC_END_MS = 600_000  # trace time: 100 s of wall time compressed by 6


def fitting_factor(segment: list[Change], measured: dict, most: float) -> float:
    """The compression for ``segment`` (trace times) on a machine whose costs are ``measured``: at most ``most``,
    at least 1, and small enough that the replay measures the segment's changes rather than restarts cut short:
    its first change comes once the run has started and trained (the measured start, 5 steps and 5 s), and
    changes at different times are at least a restart apart (a kill's restart and load, a node's boot, 3 steps).
    On an idle 2-core machine the cap decides; under load the costs do."""
    initial = sum(1 for c in segment if c.ms == 0 and c.action == "add")
    times = sorted({c.ms for c in segment[initial:]})
    if not times:
        return most
    need_start = measured["first_start_s"] + 5 * measured["step_s"] + 5.0
    need_restart = measured["kill_restart_s"] + measured["load_s"] + measured["join_boot_s"] + 3 * measured["step_s"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    fits = [times[0] / 1000 / need_start] + [g / 1000 / need_restart for g in gaps]
    return max(1.0, min(most, *fits))


