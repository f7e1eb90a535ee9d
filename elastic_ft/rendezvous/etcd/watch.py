"""Waiting for keys to appear, through an etcd watch that survives faults.

The watch starts right after the revision at which the keys were read
missing, so a put between the read and the watch is not lost. A watch broken by a
connection fault is set up again (after a fresh read) until the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from . import wire
from .errors import EtcdClientError, describe, grpc_code, hint, is_auth_token_error, is_transient
from .failover import Failover
from .kv import KeyValue

log = logging.getLogger(__name__)


def wait_for_keys(
    failover: Failover,
    read: Callable[[list[str]], tuple[list[KeyValue | None], int]],
    keys: Sequence[str],
    deadline: float,
) -> list[KeyValue | None]:
    """Block until every key of ``keys`` exists; their values, in order.

    At ``deadline`` (a :func:`time.monotonic` value) the keys still missing
    are ``None``. A key seen once counts as there, as in a wait key by key.
    ``read`` is the retried read of several keys (values and a store revision
    no later than any of the reads: chunks of many keys are read at several). One read and one watch over the range of the
    missing keys serve the whole wait, however many keys: agents meeting at a
    barrier of N keys would otherwise cost etcd N reads and watches each.
    Raises :class:`EtcdClientError` when etcd refuses the watch itself.
    """
    found: dict[str, KeyValue] = {}
    while True:
        missing = [k for k in keys if k not in found]
        values, revision = read(missing)
        found.update((k, v) for k, v in zip(missing, values) if v is not None)
        missing = [k for k in missing if k not in found]
        remaining = deadline - time.monotonic()
        if not missing or remaining <= 0:
            return [found.get(k) for k in keys]
        try:
            found.update(watch_for_puts(failover.session(), missing, revision + 1, remaining))
        except Exception as exc:
            if time.monotonic() >= deadline:
                # The stream ended at the deadline, whatever gRPC calls it;
                # the read at the top of the loop has the last word.
                continue
            if not is_transient(exc) and not is_auth_token_error(exc):
                raise EtcdClientError(
                    f"Watching {_naming(missing)} at {failover.endpoint} failed: {describe(exc)}. {hint(exc)}"
                ) from exc
            log.warning("The etcd watch on %s at %s broke (%s); reading again.", _naming(missing),
                        failover.endpoint, describe(exc))
            failover.drop(failover=is_transient(exc))
            # Do not spin while etcd is down: the read above retries with backoff.
            continue
        if all(k in found for k in keys) or time.monotonic() >= deadline:
            return [found.get(k) for k in keys]


def watch_for_puts(session: Any, keys: Sequence[str], start_revision: int, timeout: float) -> dict[str, KeyValue]:
    """One watch stream: the first PUT of each of ``keys`` at or after ``start_revision``.

    The stream watches the key range from the smallest to the largest of
    ``keys`` and ignores the other keys in it. Returns when every key was put,
    or with those seen so far when ``timeout`` passes first or the start
    revision was compacted away (the caller reads again).
    """
    import grpc

    wanted = {k.encode(): k for k in keys}
    done = threading.Event()
    create = wire.message(
        "WatchCreateRequest", key=min(wanted), range_end=max(wanted) + b"\0", start_revision=start_revision
    )

    def requests() -> Iterator[Any]:
        yield wire.message("WatchRequest", create_request=create)
        # Keep the client side of the stream open until we are done: etcd
        # treats a half-closed watch stream as finished.
        done.wait()

    found: dict[str, KeyValue] = {}
    stream = session.stream(wire.WATCH, requests(), timeout)
    try:
        for response in stream:
            if response.compact_revision:
                return found
            if response.canceled:
                raise EtcdClientError(f"etcd cancelled the watch on {_naming(keys)}: {response.cancel_reason}")
            for event in response.events:
                key = wanted.get(event.kv.key)
                if event.type == wire.EVENT_PUT and key is not None and key not in found:
                    found[key] = KeyValue(event.kv.value, event.kv.mod_revision)
            if len(found) == len(wanted):
                return found
    except grpc.RpcError as exc:
        if grpc_code(exc) == grpc.StatusCode.DEADLINE_EXCEEDED:
            return found
        raise
    finally:
        done.set()
        stream.cancel()
    return found


def _naming(keys: Sequence[str]) -> str:
    """``the etcd key 'a'``, or ``the etcd keys 'a' and 3 more``, for messages."""
    if len(keys) == 1:
        return f"the etcd key {keys[0]!r}"
    return f"the etcd keys {keys[0]!r} and {len(keys) - 1} more"
