"""``logging.tensorboard: true``: the run's events streamed to TensorBoard with torch's ``SummaryWriter``.

A sink of the leader's :class:`~elastic_ft.runevents.events.EventLog`, so the training
loop makes no TensorBoard calls of its own and only the leader writes. Into
``<events dir>/tensorboard`` (beside ``events.jsonl``) go:

- each step's ``train/loss``, ``train/lr``, ``train/tokens_per_s`` and
  ``train/world`` at its step, stamped with the time the step ended;
- ``eval/loss`` at each evaluated step (the held-out loss of the ``eval`` event);
- ``checkpoint/seconds`` at each committed checkpoint's step (the writer
  flushes there, so the steps a checkpoint covers survive a kill);
- rescales (``events/rescale``) and preemptions (``events/preemption``: a
  spot notice the job left on, or a node lost) as text at their step.

Steps redone after a restart: each attempt opens its own event file with
``purge_step`` one past the step it resumes from, so TensorBoard hides the
earlier attempt's points from there on and shows each step once, the try the
run kept (as ``elastic-ft plot`` draws it).

A record that is not a well-formed event (:mod:`~elastic_ft.runevents.schema`)
is skipped and counted, and the count logged once, at :meth:`TensorBoardSink.close`.

The ``tensorboard`` package is an optional extra; :func:`missing` is the
spec's check that it is installed, before any work.
"""

from __future__ import annotations

import logging
import math

from elastic_ft.runevents.events import console_line
from elastic_ft.runevents.schema import EventList, problem

STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "world": "train/world"}

log = logging.getLogger(__name__)


def _number(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class TensorBoardSink:
    """Writes the records it is given (see the module's docstring) under ``log_dir``; never raises."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._writer = None
        self._warned = False
        self._summary_writer = None
        self.skipped = EventList()
        try:
            # Imported here, while the trainer builds (about 2 s), not at the resume, where the other ranks wait.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # the spec checked the package is there: a broken install
            self._warn(exc)
        else:
            self._summary_writer = SummaryWriter

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            log.warning("TensorBoard: cannot write to %s (%s: %s); training goes on, events.jsonl has every "
                        "event", self.log_dir, type(exc).__name__, exc)
            self._warned = True

    def _open(self, purge_step: int | None):
        if self._writer is not None:
            self._writer.close()
        # Flushed every 10 s (TensorBoard's default is 120): a killed attempt loses little, a watcher waits little.
        self._writer = self._summary_writer(self.log_dir, purge_step=purge_step, flush_secs=10)
        return self._writer

    def write(self, record: dict, line: str | None = None) -> None:
        if self._summary_writer is None:
            return
        why = problem(record)
        if why is not None:
            self.skipped.skip(f"record {record.get('event') if isinstance(record, dict) else '?'!r}", why)
            return
        try:
            self._write(record)
        except Exception as exc:  # TensorBoard is a view of the run: never the reason it stops
            self._warn(exc)

    def _write(self, record: dict) -> None:
        name = record.get("event")
        if name == "resume_plan":
            # Hides what an earlier attempt wrote past the step this one resumes from.
            self._open(purge_step=int(record["step"]) + 1)
            return
        if name not in ("step", "eval", "checkpoint_committed", "rescale", "preempted", "node_lost"):
            return
        writer = self._writer or self._open(None)
        if name == "step":
            step, walltime = int(record["step"]), _number(record.get("t_end")) or _number(record.get("ts"))
            for field, tag in STEP_SCALARS.items():
                value = _number(record.get(field))
                if value is not None:
                    writer.add_scalar(tag, value, step, walltime=walltime)
        elif name == "eval":
            value = _number(record.get("loss"))
            if value is not None:
                writer.add_scalar("eval/loss", value, int(record["step"]), walltime=record.get("ts"))
        elif name == "checkpoint_committed":
            seconds = _number(record.get("seconds"))
            if seconds is not None:
                writer.add_scalar("checkpoint/seconds", seconds, int(record["step"]), walltime=record.get("ts"))
            # Every step this checkpoint covers is on disk now: an attempt killed later loses only steps
            # that the next one trains again (and purges).
            writer.flush()
        else:
            step = record.get("step", record.get("resume_after_step", 0))
            tag = "events/rescale" if name == "rescale" else "events/preemption"
            writer.add_text(tag, console_line(record), int(step or 0), walltime=record.get("ts"))
            writer.flush()  # rare, and what a person watching looks for

    def close(self) -> None:
        note = self.skipped.note(f"what was sent to TensorBoard at {self.log_dir}")
        if note:
            log.warning("TensorBoard: %s", note)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
