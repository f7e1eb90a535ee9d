"""Where a run's events live in its checkpoint store, and how a leader claims its attempt number.

Keys, relative to the run's location (``<checkpoint_uri>/<run_id>``):

- ``events/<attempt>-<first seq>-<writer>.jsonl`` (attempt and seq zero-padded): one shipment, the
  JSON lines of the events a leader emitted since its previous shipment. ``seq`` numbers a leader's
  events in the order it emitted them (from 0); the object's first line is event ``first seq``, so
  every event has an identity ``(attempt, writer, seq)`` and a re-shipped batch (a put whose reply
  was lost) is merged once. ``writer`` is the shipping process's token. Written once, never
  replaced (create-if-absent), never deleted by checkpoint gc (which keeps to ``blobs/`` and
  ``manifests/``).
- ``events/attempts/<attempt>.json``: the claim of an attempt number (who, when), created with
  create-if-absent: of two leaders that try the same number, one gets it and the other tries the
  next. So attempt numbers are unique and increasing across machines, which counting ``start``
  events in one machine's file cannot give.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid

import tenacity

from elastic_ft.checkpoint.errors import ObjectExists, ObjectNotFound, StoreError
from elastic_ft.checkpoint.store import ObjectStore

log = logging.getLogger(__name__)

PREFIX = "events/"
ATTEMPTS_PREFIX = "events/attempts/"
_BATCH = re.compile(r"^events/(\d+)-(\d+)-([0-9A-Za-z_.-]+)\.jsonl$")
_ATTEMPT = re.compile(r"^events/attempts/(\d+)\.json$")
MAX_CLAIM_TRIES = 1000


def batch_key(attempt: int, first_seq: int, writer: str) -> str:
    return f"{PREFIX}{attempt:08d}-{first_seq:010d}-{writer}.jsonl"


def parse_batch_key(key: str) -> tuple[int, int, str] | None:
    """``(attempt, first seq, writer)`` of a shipment's key; None for any other key (claims, foreign objects)."""
    m = _BATCH.match(key)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def attempt_key(attempt: int) -> str:
    return f"{ATTEMPTS_PREFIX}{attempt:08d}.json"


def claimed_attempts(store: ObjectStore) -> list[int]:
    """The attempt numbers claimed in ``store``, ascending."""
    return sorted(int(m.group(1)) for o in store.list(ATTEMPTS_PREFIX) if (m := _ATTEMPT.match(o.key)))


def new_writer() -> str:
    return uuid.uuid4().hex[:12]


def claim_attempt(store: ObjectStore, at_least: int = 1, *, writer: str | None = None) -> int:
    """Claim the next attempt number of the run in ``store`` and return it.

    Starts from the larger of ``at_least`` (this machine's own count, from its
    ``events.jsonl``) and one past the highest claimed, and goes up while
    another leader holds the number. A claim that exists with our own token is
    ours (a retried put whose first reply was lost). Raises the store's
    :class:`~elastic_ft.checkpoint.store.StoreError` when it cannot answer, and
    RuntimeError after :data:`MAX_CLAIM_TRIES` numbers taken in a row.
    """
    writer = writer or new_writer()
    n = max(at_least, max(claimed_attempts(store), default=0) + 1)
    doc = {"writer": writer, "host": socket.gethostname(), "pid": os.getpid(), "claimed": round(time.time(), 3)}
    for _ in range(MAX_CLAIM_TRIES):
        key = attempt_key(n)
        try:
            store.put(key, json.dumps(doc).encode(), if_absent=True)
            return n
        except ObjectExists:
            if _claimed_by(store, key) == writer:
                return n
            n += 1
    raise RuntimeError(f"could not claim an attempt number in {store.join(ATTEMPTS_PREFIX)}: "
                       f"{MAX_CLAIM_TRIES} numbers in a row were taken by other leaders")


def claim_attempt_retrying(store: ObjectStore, at_least: int = 1, *, tries: int = 3, backoff_s: float = 1.0) -> int:
    """:func:`claim_attempt`, tried ``tries`` times with exponential backoff while the store fails.

    At a worker's start, the store's own retries (a few seconds on S3) are all that stands between a
    short outage and a failed start of every rank; a claim made anyway, whose reply was lost, is found
    by the next try as ours (one token for every try). Raises :class:`StoreError` naming the count.
    """
    writer = new_writer()
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(tries),
        wait=tenacity.wait_exponential(multiplier=backoff_s, max=8),
        retry=tenacity.retry_if_exception_type(StoreError),
        before_sleep=lambda rs: log.warning("claiming the attempt number in %s: try %d of %d failed (%s); retrying",
                                            store.join(ATTEMPTS_PREFIX), rs.attempt_number, tries,
                                            rs.outcome.exception()),
        reraise=True,
    )
    try:
        return retrying(claim_attempt, store, at_least, writer=writer)
    except StoreError as exc:
        raise StoreError(f"the attempt number not claimed after {tries} tries: {exc}") from exc


def _claimed_by(store: ObjectStore, key: str) -> str | None:
    try:
        return json.loads(bytes(store.get(key))).get("writer")
    except (ObjectNotFound, ValueError, AttributeError):
        return None
