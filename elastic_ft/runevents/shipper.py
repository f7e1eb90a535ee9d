"""The leader's side: the events emitted since the last shipment, shipped to the store as one object.

The :class:`Shipper` listens to the leader's :class:`~elastic_ft.runevents.events.EventLog`
(each event, serialised as the file's line, is numbered in emission order) and
:meth:`Shipper.ship` writes the lines not shipped yet as one immutable object
(:func:`~elastic_ft.runevents.layout.batch_key`). Lines leave the queue only
once they are in the store: a failed shipment keeps them for the next one.

When: on the checkpoint saver's thread, after the checkpoint's blobs and before
its manifest (:meth:`before_commit`, given to the
:class:`~elastic_ft.checkpoint.saver.AsyncSaver`), so training does not wait,
and the events of every step a committed checkpoint covers are in the store
before it exists. If the shipment fails after its retries the manifest is not
committed: the save fails as for a blob that could not be written (an event,
and the run goes on until ``checkpoint.max_failed_saves`` in a row). And at
the end of the worker (:meth:`ship_final`, best effort: the ``end``,
``preempted`` or ``aborted`` event; never raises).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from elastic_ft.checkpoint.errors import ObjectExists, StoreError
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.runevents.events import EventLog, next_attempt
from elastic_ft.runevents.layout import batch_key, claim_attempt_retrying, new_writer

log = logging.getLogger(__name__)


class Shipper:
    """Ships one attempt's events to ``store`` (the run's location). Thread-safe."""

    def __init__(self, store: ObjectStore, attempt: int, *, writer: str | None = None, attempts: int = 3,
                 backoff_s: float = 0.5) -> None:
        self.store, self.attempt = store, attempt
        self.writer = writer or new_writer()
        self.attempts, self.backoff_s = attempts, backoff_s
        self._lock = threading.Lock()  # the queue: the training and the saver's threads emit
        self._shipping = threading.Lock()  # one shipment at a time, so seqs go up in key order
        self._pending: list[str] = []
        self._first = 0  # seq of _pending[0]
        self.shipped: list[str] = []
        """Keys written, in order."""

    def write(self, record: dict, line: str | None = None) -> None:
        """As an :class:`~elastic_ft.runevents.events.EventLog` sink: queue the event (called in emission order).

        ``line``: the record as the log's file has it, which the store then holds byte for byte;
        serialised here only when a caller gives none.
        """
        if line is None:
            line = json.dumps(record, sort_keys=False, default=str)
        with self._lock:
            self._pending.append(line)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def ship(self, *, wait_s: float = -1) -> str | None:
        """Write the queued events as one object; its key, or None when none were queued.

        Retries a :class:`StoreError` ``attempts`` times with backoff, then raises it. ``wait_s``
        bounds the wait for a shipment in flight on another thread (-1: no bound); past it,
        :class:`TimeoutError`.
        """
        if not self._shipping.acquire(timeout=wait_s):
            raise TimeoutError(f"another shipment of the run's events was still in flight after {wait_s:g} s")
        try:
            for n in range(1, self.attempts + 1):
                try:
                    return self._ship_once()
                except StoreError as exc:
                    if n == self.attempts:
                        raise StoreError(f"the run's events (attempt {self.attempt}) not shipped after {n} "
                                         f"tries: {exc}") from exc
                    log.warning("shipping events: try %d failed (%s); retrying", n, exc)
                    time.sleep(self.backoff_s * 2 ** (n - 1))
        finally:
            self._shipping.release()
        return None  # not reached

    def _ship_once(self) -> str | None:
        with self._lock:
            lines, first = list(self._pending), self._first
        if not lines:
            return None
        key = batch_key(self.attempt, first, self.writer)
        try:
            self.store.put(key, ("\n".join(lines) + "\n").encode(), if_absent=True)
            done = len(lines)
        except ObjectExists:
            # Our own earlier put of this key landed though it reported a failure: only the lines it holds
            # are shipped (a later one may hold more of the queue, with this same first seq).
            done = len(bytes(self.store.get(key)).decode().splitlines())
        with self._lock:
            del self._pending[:done]
            self._first += done
        self.shipped.append(key)
        return key

    def before_commit(self, snap: Any = None) -> None:
        """The saver's hook between a checkpoint's blobs and its manifest: ship; raise if it cannot."""
        self.ship()

    def close(self) -> None:
        """As a sink, when its event log closes at the worker's end: :meth:`ship_final`."""
        self.ship_final()

    def ship_final(self, wait_s: float = 10.0) -> None:
        """Best effort at the worker's end: ship what is queued; log, never raise.

        A save stuck in its shipment (the saver gave up waiting for it) holds this one up ``wait_s`` at most.
        """
        try:
            self.ship(wait_s=wait_s)
        except Exception as exc:  # the run's outcome stands; its local events.jsonl keeps these
            log.warning("the last events of attempt %d were not shipped to %s: %s", self.attempt,
                        self.store.uri, exc)


def leader_attempt(world: Any, store: ObjectStore, local_next: int | None) -> int:
    """The attempt number, claimed in ``store`` by the leader and known to every rank (a collective).

    ``local_next`` is the leader's own count (:func:`~elastic_ft.runevents.events.next_attempt`), None elsewhere.
    A store that cannot answer is raised on every rank alike, as :class:`StoreError`.
    ``world`` is the trainer's (:class:`elastic_ft.train.world.World`, a layer above: passed in, not imported).
    """
    claimed: tuple[int | None, str | None] = (None, None)
    if world.is_leader:
        try:
            claimed = (claim_attempt_retrying(store, local_next or 1), None)
        except (StoreError, RuntimeError) as exc:
            claimed = (None, f"could not claim this attempt's number in {store.uri}: {exc}")
    attempt, problem = world.from_leader(claimed)
    if problem is not None:
        raise StoreError(problem)
    return attempt


def open_run_events(world: Any, store: ObjectStore, path: str, *, node_head: bool = False,
                    **common: Any) -> tuple[EventLog, Shipper | None]:
    """The trainer's event log (writing ``path`` on the leader) and, on the leader, its shipper to ``store``.

    Every event carries ``common`` and ``attempt``, claimed in the store (:func:`leader_attempt`: a
    collective), so a step redone after a restart is told from its first try, whichever machine leads.
    ``node_head``: as :class:`~elastic_ft.runevents.events.EventLog` takes it.
    """
    attempt = leader_attempt(world, store, next_attempt(path) if world.is_leader else None)
    events = EventLog(path if world.is_leader else None, node_head=node_head, **common, attempt=attempt)
    shipper = Shipper(store, attempt) if world.is_leader else None
    if shipper is not None:
        events.add_sink(shipper)
    return events, shipper
