"""The shape of a stored event: which fields each kind must have, checked in one place for every reader.

A run's events come back from files and object stores that anything may have
touched: a torn line of a killed writer, an event written by another version,
or a hand-edited file. Every reader of stored events (``status``, ``events``,
``goodput``, ``plot``, the TensorBoard sink, the ledger replay, the merge of
shipped batches) passes them through :func:`screen` (or :func:`valid`): an
event that is not a JSON object, or lacks a field its kind needs, is skipped
and counted, never a traceback; the commands report the count once.

:data:`REQUIRED` lists what the readers index without a default (a ``step``
event's ``step``, a ``step_done``'s ``seconds``, ...); :data:`OPTIONAL` what
they convert when it is there. Cost: one pass over the events, each checked
in time proportional to its fields (a ledger event's sample pairs included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    # JSON has no NaN or infinity: the trainer writes those as text (train.metrics.number)
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in _NON_FINITE


_NON_FINITE = ("nan", "inf", "-inf", "NaN", "Infinity", "-Infinity")


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _samples(v: Any) -> bool:
    # per rank, a list of (epoch, index) pairs
    return isinstance(v, list) and all(
        isinstance(rank, list) and all(isinstance(p, list) and len(p) == 2 and all(map(_int, p)) for p in rank)
        for rank in v)


def _changes(v: Any) -> bool:
    # a rescale's {field: {"old": ..., "new": ...}}
    return isinstance(v, dict) and all(isinstance(c, dict) for c in v.values())


_KINDS: dict[Callable[[Any], bool], str] = {
    _int: "a whole number >= 0", _number: "a number", _time: "a finite number of seconds", _text: "text",
    _samples: "a list per rank of [epoch, index] pairs", _changes: "a mapping of {old, new} per field",
}

COMMON: dict[str, Callable[[Any], bool]] = {"event": _text}
"""Fields of every event (:meth:`~elastic_ft.runevents.events.EventLog.emit` writes ``ts`` too; the
readers place an event without one by its neighbours, except where :data:`REQUIRED` says)."""

REQUIRED: dict[str, dict[str, Callable[[Any], bool]]] = {
    "start": {"ts": _time},
    "resume_plan": {"step": _int},
    "step": {"step": _int, "ts": _time},
    "step_done": {"step": _int, "seconds": _number, "ts": _time},
    "step_skipped": {"step": _int},
    "ledger": {"step": _int, "samples": _samples},
    "checkpoint_committed": {"step": _int},
    "checkpoint_failed": {"step": _int},
    "checkpoint_skipped": {"step": _int},
    "eval": {"step": _int, "loss": _number},
}
"""Per kind, the fields the readers use without a default."""

OPTIONAL: dict[str, dict[str, Callable[[Any], bool]]] = {
    "*": {"ts": _time, "attempt": _int, "world": _int, "step": _int},
    "start": {"process_start": _number, "agent_start": _number, "total_steps": _int},
    "step": {"t_end": _number},
    "rescale": {"changed": _changes},
    "node_lost": {"resume_after_step": _int},
    "eval": {"tokens": _int, "samples": _int},
}
"""Per kind (``*``: every kind), fields that must have this shape when present and not null."""


def problem(event: Any) -> str | None:
    """Why ``event`` cannot be read (one phrase naming the field), or None for a well-formed event."""
    if not isinstance(event, dict):
        return f"not a JSON object but {type(event).__name__}"
    for name, ok in COMMON.items():
        if name not in event:
            return f"no {name!r} field"
        if not ok(event[name]):
            return f"{name!r} is {_shown(event[name])}, not {_KINDS[ok]}"
    kind = event["event"]
    for name, ok in REQUIRED.get(kind, {}).items():
        if name not in event or event[name] is None:
            return f"a {kind!r} event without {name!r} ({_KINDS[ok]})"
        if not ok(event[name]):
            return f"a {kind!r} event whose {name!r} is {_shown(event[name])}, not {_KINDS[ok]}"
    for fields in (OPTIONAL["*"], OPTIONAL.get(kind, {})):
        for name, ok in fields.items():
            value = event.get(name)
            if value is not None and not ok(value):
                return f"a {kind!r} event whose {name!r} is {_shown(value)}, not {_KINDS[ok]}"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({type(value).__name__})"


class EventList(list):
    """Events that passed :func:`problem`, with the count of those that did not (``skipped``) and the
    first of them (``first``: where, and why). A list, so every caller of a reader keeps working; its
    type also says "already screened", so :func:`valid` does not check the events again."""

    def __init__(self, events: Iterable[dict] = (), *, skipped: int = 0, first: str | None = None) -> None:
        super().__init__(events)
        self.skipped = skipped
        self.first = first

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if self.first is None:
            self.first = f"{where}: {why}"

    def note(self, source: str) -> str | None:
        """The one line a command prints about the skipped events of ``source``, or None when none was."""
        if not self.skipped:
            return None
        return (f"skipped {self.skipped} malformed event(s) in {source} (the first: {self.first}); "
                f"the rest is read as usual")


def screen(events: Iterable[Any], where: Callable[[int], str] = lambda i: f"event {i + 1}") -> EventList:
    """The well-formed events of ``events``, in order, counting the others; ``where(i)`` names the i-th
    (a line of a file, say) in the note."""
    out = EventList()
    for i, e in enumerate(events):
        why = problem(e)
        if why is None:
            out.append(e)
        else:
            out.skip(where(i), why)
    return out


def valid(events: Iterable[Any]) -> EventList:
    """``events`` screened, or as they are when they already were (an :class:`EventList`)."""
    return events if isinstance(events, EventList) else screen(events)
