"""Structured events: one JSON line per event in ``events.jsonl``, one short human line in the log.

Events are what a person plots or greps after a run: start, resume plan,
rescale, checkpoint committed, step metrics, end. Each is one line, so a
crashed run's file is still valid up to its last event.

Each worker start that writes a run's events begins an *attempt* (its
``start`` event); the trainer puts ``attempt`` in every event, so a step
trained again after a restart is told apart from its first try. The number is
claimed in the run's checkpoint store (:mod:`elastic_ft.runevents`), starting
from :func:`next_attempt` of this machine's file: a new leader may be on
another machine, whose file knows nothing of the attempts before it. torchrun's
``TORCHELASTIC_RESTART_COUNT`` cannot do that either: an agent does not count a
restart for a change of membership (a node lost or joined), and a replacement
node's agent counts from 0.

Where a run's events go (:func:`events_dir`) depends on the run, not on the
working directory a command happens to run in: with a ``file://`` checkpoint
URI, in the run's own directory beside its checkpoints; with ``s3://``, in a
directory of this machine named after the run. The leader also ships them to
the run's location in the store (``<run>/events/``, :mod:`elastic_ft.runevents`),
so that no node's loss takes a committed step's events with it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from elastic_ft.runevents.schema import EventList, problem

log = logging.getLogger("elastic_ft.runevents.events")


NODE_EVENTS = frozenset({"resume_plan", "rescale", "preempted", "aborted", "end"})
"""The events whose line a node without the leader shows too: how the run goes on, seen from that node."""


class Sink(Protocol):
    """Where else an :class:`EventLog` sends each record (the store's shipper, TensorBoard): must not raise,
    nor block for long."""

    def write(self, record: dict, line: str) -> None:
        """``line``: the record as the file has it (JSON, no newline), serialised once for the file and
        every sink (the leader emits per step)."""

    def close(self) -> None: ...


class EventLog:
    """Appends events to ``path`` (None: log only, e.g. on ranks other than 0), and passes them to its sinks.

    ``node_head``: this process speaks for a node that does not hold the
    leader (its local rank 0), so the :data:`NODE_EVENTS` show on that
    node's console too; every other rank's lines, duplicates of the leader's,
    are kept at DEBUG.
    """

    def __init__(self, path: str | None, *, node_head: bool = False, **common: Any) -> None:
        self.path = path
        self.node_head = node_head
        self.common = common
        self._file = None
        self._sinks: list[Sink] = []
        self._lock = threading.Lock()  # the checkpoint thread emits too
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # Line-buffered append: a killed process loses at most the line in flight.
            self._file = open(path, "a", buffering=1)

    def emit(self, event: str, *, quiet: bool = False, **fields: Any) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **self.common, **fields}
        line = json.dumps(record, sort_keys=False, default=str)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
            for sink in self._sinks:  # under the lock: a sink sees the records in the file's order
                sink.write(record, line)
        if not quiet:
            shown = self._file is not None or (self.node_head and event in NODE_EVENTS)
            log.log(logging.INFO if shown else logging.DEBUG, "%s", console_line(record))
        return record

    def add_sink(self, sink: Sink) -> None:
        """Pass every record emitted from now on to ``sink`` too; :meth:`close` closes it."""
        with self._lock:
            self._sinks.append(sink)

    def close(self) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
        if self._file is not None:
            self._file.close()
            self._file = None


_NOT_SHOWN = ("ts", "event", "run_id", "attempt")  # on every event; the console's own timestamp is there


def console_line(record: dict) -> str:
    """The short line a person watching the console reads for an event (the file keeps the whole record).

    The events a run always has read as sentences; any other shows its
    scalar fields (lists and mappings, such as a ledger's samples, stay in
    the file).
    """
    e, name = record, record.get("event")
    if name == "start":
        return (f"start: attempt {e.get('attempt')} of run {e.get('run_id')}, world {e.get('world')}, "
                f"{e.get('total_steps')} steps")
    if name == "resume_plan":
        return f"resume: {e.get('reason')}"
    if name == "rescale":
        changed = ", ".join(f"{k} {v.get('old')} -> {v.get('new')}" for k, v in (e.get("changed") or {}).items())
        return f"rescale at step {e.get('step')}: {changed} ({e.get('reason')})"
    if name == "checkpoint_committed":
        size = e.get("bytes")
        return (f"checkpoint at step {e.get('step')} committed ({e.get('reason')}): "
                f"{f'{size:,}' if isinstance(size, int) else size} bytes in {e.get('seconds')} s")
    fields = [f"{k} {_scalar(v)}" for k, v in e.items()
              if k not in _NOT_SHOWN and v is not None and not isinstance(v, (dict, list, tuple))]
    return f"{name}: {', '.join(fields)}"


def joined_line(run_id: str, rank: int, local_size: int, world_size: int, attempt: int) -> str:
    """What a node without the leader prints as its workers start: which ranks of which world it holds.

    torchrun deals each node a contiguous block of global ranks, from its local rank 0's.
    """
    ranks = f"rank {rank}" if local_size == 1 else f"ranks {rank}-{rank + local_size - 1}"
    return f"joined run {run_id} (attempt {attempt}): this node holds {ranks} of world {world_size}"


def _scalar(v: Any) -> str:
    return f"{v:.5g}" if isinstance(v, float) else str(v)


def local_runs_root(environ: Mapping[str, str] | None = None) -> str:
    """This machine's directory of runs whose checkpoints are not on a filesystem:
    ``$XDG_CACHE_HOME/elastic_ft/runs`` (``~/.cache/elastic_ft/runs``), beside the input cache."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastic_ft", "runs")


def events_dir(checkpoint_uri: str, run_id: str, *, template: str | None = None,
               environ: Mapping[str, str] | None = None) -> str:
    """The directory of a run's ``events.jsonl``.

    ``template`` (the spec's ``logging.dir``), when set, with ``{run_id}``
    substituted (relative to the working directory). Otherwise the run's
    directory's ``logs/`` for a ``file://`` checkpoint URI (or a plain path):
    ``<path>/<run_id>/logs``, beside the checkpoints (relative when the URI's
    path is, as the checkpoints are); for any other scheme (``s3://``),
    :func:`local_runs_root` ``/<run_id>/logs``. Raises what
    :func:`~elastic_ft.checkpoint.store.check_uri` raises for a bad URI.
    """
    from elastic_ft.checkpoint.store import check_uri

    if template is not None:
        return template.format(run_id=run_id)
    path = check_uri(checkpoint_uri)
    return os.path.join(path if path is not None else local_runs_root(environ), run_id, "logs")


_START = '"event": "start"'  # as json.dumps writes it (EventLog.emit)


def next_attempt(path: str) -> int:
    """The number of the attempt that starts now: one more than the ``start`` events already in ``path``.

    1 for a file not there yet. Lines are matched as text before being
    parsed, so a long run's file (ledger events) is read quickly.
    """
    try:
        with open(path) as f:
            starts = sum(1 for line in f if _START in line and _event_of(line) == "start")
    except FileNotFoundError:
        return 1
    return starts + 1


def _event_of(line: str) -> str | None:
    try:
        return json.loads(line).get("event")
    except (json.JSONDecodeError, AttributeError):
        return None


def read_events(path: str) -> EventList:
    """The well-formed events of a file, in order (:mod:`~elastic_ft.runevents.schema`).

    A line that is not an event (a torn last line of a writer killed
    mid-write, a line without a field its kind needs) is skipped and counted
    in the result's ``skipped``, with the first one's line number in ``first``.
    """
    out = EventList()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                out.skip(f"line {n}", "not JSON (a writer killed mid-line leaves one)")
                continue
            why = problem(event)
            if why is None:
                out.append(event)
            else:
                out.skip(f"line {n}", why)
    return out
