"""Structured events: one JSON line per event, in ``events.jsonl`` and in the log.

Events are what a person plots or greps after a run: start, resume plan,
rescale, checkpoint committed, step metrics, end. Each is one line, so a
crashed run's file is still valid up to its last event.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("elastic_ft.events")


class EventLog:
    """Appends events to ``path`` (None: log only, e.g. on ranks other than 0)."""

    def __init__(self, path: str | None, **common: Any) -> None:
        self.path = path
        self.common = common
        self._file = None
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
        if not quiet:
            # Other ranks' events duplicate the leader's: keep them for debugging only.
            log.log(logging.INFO if self._file is not None else logging.DEBUG, "%s", line)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str) -> list[dict]:
    """All events of a file; a torn last line (writer killed mid-write) is ignored."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
