"""What a run's earlier attempts tell a new one about failures: how many were lost, over how long the run
trained, and the newest commit cost and step time they measured (for ``checkpoint.every_steps: auto``).

An earlier attempt is a *loss* when its events in the store hold no clean exit: ``end`` (finished),
``preempted`` (committed and left on a notice, also the SIGTERM with which torchrun restarts the workers
for a node that joins: an announced change) or ``aborted`` (the run stopped itself, with its reason). So a
killed worker, a lost node or a crash is a loss, and so is an attempt killed before it shipped anything:
its claim (``events/attempts/``) is there, its events are not. A clean exit whose last shipment failed
(best effort) reads as a loss too: the error makes the interval shorter, never longer.

The time the run trained, against which losses count: each earlier attempt from its claim to the next
attempt's claim after a loss (the loss's detection and restart included), or to its last event after a
clean exit (a run stopped for a week is not a week without failure).

Reads, at a worker's (re)start, by the leader: one LIST of the attempt claims, then for each of the last
:data:`WINDOW` earlier attempts its claim, a LIST of its own shipments (one per checkpoint it committed,
1000 keys per request) and its last shipment, 8 requests at a time (the last shipment holds the attempt's
end: a clean exit is shipped last). Nothing grows with the model, the data or the node count.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import statistics

from elastic_ft.checkpoint.errors import ObjectNotFound
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.runevents.layout import PREFIX, attempt_key, claimed_attempts, parse_batch_key

WINDOW = 64
"""Earlier attempts read: the recent failure rate is the one the next interval faces (a fleet's
interruption rate changes over hours), and a restart's reads stay bounded however long the run."""

CLEAN_EXITS = ("end", "preempted", "aborted")
"""The last events of an attempt that ended as it chose (not a loss): ``elastic-ft status`` counts the
others as cut short, and ``every_steps: auto`` as losses."""


@dataclasses.dataclass(frozen=True)
class AttemptHistory:
    """The earlier attempts' figures (see the module's docstring); every field None or 0 for a first attempt."""

    attempts: int = 0
    """Earlier attempts read (at most :data:`WINDOW`)."""
    losses: int = 0
    exposure_s: float = 0.0
    """Seconds those attempts trained, as defined above."""
    current_start: float | None = None
    """When the current attempt was claimed (wall clock): the current attempt's exposure runs from it."""
    commit_s: float | None = None
    """Seconds the newest committed save found blocked training (its ``blocked_s``; a synchronous save's whole time)."""
    step_s: float | None = None
    """Median step time of the newest attempt's last shipment."""


def summarize(claims: dict[int, float | None], last_events: dict[int, list[dict]], current: int) -> AttemptHistory:
    """The history of the attempts before ``current`` (pure).

    ``claims``: attempt -> when it was claimed (None: unreadable), the current one's included;
    ``last_events``: attempt -> the events of its last shipment ([] or absent: none shipped).
    """
    earlier = sorted(a for a in claims if a < current)
    losses, exposure, commit_s, step_s = 0, 0.0, None, None
    for i, a in enumerate(earlier):
        events = last_events.get(a, [])
        clean = any(e.get("event") in CLEAN_EXITS for e in events)
        losses += not clean
        start = claims[a]
        nxt = claims.get(earlier[i + 1] if i + 1 < len(earlier) else current)
        times = [float(e["ts"]) for e in events if isinstance(e.get("ts"), (int, float))]
        end = (max(times) if times else None) if clean else nxt
        if start is not None and end is not None:
            exposure += max(0.0, end - start)
        commit_s = _commit_seconds(events) or commit_s
        steps = [float(e["seconds"]) for e in events
                 if e.get("event") == "step_done" and isinstance(e.get("seconds"), (int, float))]
        step_s = statistics.median(steps) if steps else step_s
    return AttemptHistory(attempts=len(earlier), losses=losses, exposure_s=exposure,
                          current_start=claims.get(current), commit_s=commit_s, step_s=step_s)


def _commit_seconds(events: list[dict]) -> float | None:
    """The newest committed save's blocking time among ``events`` (None: no commit there)."""
    for e in reversed(events):
        if e.get("event") == "checkpoint_committed":
            value = e.get("blocked_s") if e.get("blocked_s") is not None else e.get("seconds")
            if isinstance(value, (int, float)) and value >= 0:
                return float(value)
    return None


def read_history(store: ObjectStore, current: int, *, window: int = WINDOW) -> AttemptHistory:
    """:func:`summarize` of the last ``window`` attempts before ``current`` in ``store`` (the run's location).

    Raises the store's errors (the caller decides without the history).
    """
    numbers = [a for a in claimed_attempts(store) if a < current][-window:]

    def newest_shipment(a: int) -> str | None:
        # The attempt's own shipments only (keys begin with its zero-padded number: layout.batch_key).
        found = [(p[1], o.key) for o in store.list(f"{PREFIX}{a:08d}-")
                 if (p := parse_batch_key(o.key)) is not None and p[0] == a]
        return max(found)[1] if found else None

    def claim(a: int) -> float | None:
        try:
            value = json.loads(bytes(store.get(attempt_key(a)))).get("claimed")
        except (ObjectNotFound, ValueError, AttributeError):
            return None
        return float(value) if isinstance(value, (int, float)) else None

    def shipment(a: int) -> list[dict]:
        key = newest_shipment(a)
        if key is None:
            return []
        out = []
        for line in bytes(store.get(key)).decode("utf-8", "replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line: the rest of the shipment still says how the attempt ended
            if isinstance(event, dict):
                out.append(event)
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="history-read") as pool:
        claims = dict(zip([*numbers, current], pool.map(claim, [*numbers, current])))
        shipped = dict(zip(numbers, pool.map(shipment, numbers)))
    return summarize(claims, shipped, current)
