"""The rule that turns a run's shipped batches into one history (pure: no I/O).

Order: by attempt, then by the order the attempt's leader emitted its events
(``seq``). Attempts follow one another in time (a leader claims its number
when it starts, after the previous leader's workers stopped), so this is the
order of their timestamps wherever the machines' clocks agree, and it keeps
each attempt's events together after its ``start`` even where they do not
(which :func:`~elastic_ft.runevents.goodput.attribute` relies on). An event shipped
twice (a retried put) appears once: events are identified by
``(attempt, writer, seq)``.

Steps trained again: a leader that trained steps past its last commit and
died, or shipped events whose checkpoint never committed, left events of
steps that the next attempt trains again from the checkpoint it resumes.
:func:`latest_steps` keeps, for each step, only the events of the newest
attempt that trained it (the one whose result the checkpoints that follow
hold): a step's ``step``, ``step_done``, ``step_skipped`` and ``ledger``
events then appear once. Every other event (``start``, ``resume_plan``,
``rescale``, ``checkpoint_committed``, ``preempted``, ``node_lost``, ``end``,
...) is kept, once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from elastic_ft.runevents.layout import parse_batch_key
from elastic_ft.runevents.schema import EventList, problem, valid

STEP_EVENTS = ("step", "step_done", "step_skipped", "ledger")
"""Events of one trained step: superseded when a later attempt trains the step again."""


def parse_batch(key: str, text: str, skipped: EventList | None = None) -> list[tuple[tuple[int, int, str], dict]]:
    """The ``((attempt, seq, writer), event)`` pairs of one shipped object; [] for a key that is not a batch.

    A line that is not a well-formed event (:func:`~elastic_ft.runevents.schema.problem`) is skipped
    (it still counts in ``seq``), and counted in ``skipped`` when given.
    """
    parsed = parse_batch_key(key)
    if parsed is None:
        return []
    attempt, first, writer = parsed
    out = []
    for i, line in enumerate(text.splitlines()):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            why: str | None = "not JSON"
        else:
            why = problem(event)
        if why is None:
            out.append(((attempt, first + i, writer), event))
        elif skipped is not None:
            skipped.skip(f"{key} line {i + 1}", why)
    return out


def merge(batches: Iterable[tuple[str, str]]) -> EventList:
    """Every well-formed event of the ``(key, text)`` objects once, in the run's order (see the module);
    the malformed ones are counted in the result's ``skipped``."""
    seen: dict[tuple[int, int, str], dict] = {}
    bad = EventList()
    for key, text in batches:
        for ident, event in parse_batch(key, text, bad):
            seen.setdefault(ident, event)
    # One process ships an attempt's events (its leader), so (attempt, seq) is the order; the writer only
    # makes the sort total.
    return EventList((seen[k] for k in sorted(seen)), skipped=bad.skipped, first=bad.first)


def trained_step(event: dict) -> int | None:
    """The step (counted from 1) a per-step event belongs to; None for other events.

    A ledger event's ``step`` is the step's index (from 0): the samples of the step that ends at ``step + 1``.
    """
    name, step = event.get("event"), event.get("step")
    if name not in STEP_EVENTS or not isinstance(step, int):
        return None
    return step + 1 if name == "ledger" else step


def latest_steps(events: list[dict]) -> EventList:
    """``events`` without the per-step events of steps that a later attempt trained again (order kept);
    malformed events are skipped (:func:`~elastic_ft.runevents.schema.valid`) and their count kept."""
    events = valid(events)
    newest: dict[int, int] = {}
    for e in events:
        step = trained_step(e)
        if step is not None:
            newest[step] = max(newest.get(step, -1), _attempt(e))
    return EventList((e for e in events if (s := trained_step(e)) is None or _attempt(e) == newest[s]),
                     skipped=events.skipped, first=events.first)


def _attempt(event: dict) -> int:
    a = event.get("attempt")
    return a if isinstance(a, int) else 0
