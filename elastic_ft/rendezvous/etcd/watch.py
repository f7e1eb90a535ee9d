"""Waiting for a key to appear, through an etcd watch that survives faults.

The watch starts right after the revision at which the key was read missing,
so a put between the read and the watch is not lost. A watch broken by a
connection fault is set up again (after a fresh read) until the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

from . import wire
from .errors import EtcdClientError, describe, grpc_code, hint, is_auth_token_error, is_transient
from .failover import Failover
from .kv import KeyValue

log = logging.getLogger(__name__)


def wait_for_key(
    failover: Failover,
    read: Callable[[str], tuple[KeyValue | None, int]],
    key: str,
    deadline: float,
) -> KeyValue | None:
    """Block until ``key`` exists; ``None`` at ``deadline`` (a :func:`time.monotonic` value).

    ``read`` is the retried read of one key (value and store revision).
    Raises :class:`EtcdClientError` when etcd refuses the watch itself.
    """
    while True:
        current, revision = read(key)
        if current is not None:
            return current
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            found = watch_for_put(failover.session(), key, revision + 1, remaining)
        except Exception as exc:
            if time.monotonic() >= deadline:
                # The stream ended at the deadline, whatever gRPC calls it;
                # the read at the top of the loop has the last word.
                continue
            if not is_transient(exc) and not is_auth_token_error(exc):
                raise EtcdClientError(
                    f"Watching the etcd key {key!r} at {failover.endpoint} failed: "
                    f"{describe(exc)}. {hint(exc)}"
                ) from exc
            log.warning("The etcd watch on %r at %s broke (%s); reading the key again.", key, failover.endpoint,
                        describe(exc))
            failover.drop(failover=is_transient(exc))
            # Do not spin while etcd is down: the read above retries with backoff.
            continue
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            return None


def watch_for_put(session: Any, key: str, start_revision: int, timeout: float) -> KeyValue | None:
    """One watch stream: the first PUT of ``key`` at or after ``start_revision``.

    ``None`` when ``timeout`` passes first or the start revision was compacted
    away (the caller reads again).
    """
    import grpc

    done = threading.Event()
    create = wire.message("WatchCreateRequest", key=key.encode(), start_revision=start_revision)

    def requests() -> Iterator[Any]:
        yield wire.message("WatchRequest", create_request=create)
        # Keep the client side of the stream open until we are done: etcd
        # treats a half-closed watch stream as finished.
        done.wait()

    stream = session.stream(wire.WATCH, requests(), timeout)
    try:
        for response in stream:
            if response.compact_revision:
                return None
            if response.canceled:
                raise EtcdClientError(f"etcd cancelled the watch on {key!r}: {response.cancel_reason}")
            for event in response.events:
                if event.type == wire.EVENT_PUT:
                    return KeyValue(event.kv.value, event.kv.mod_revision)
    except grpc.RpcError as exc:
        if grpc_code(exc) == grpc.StatusCode.DEADLINE_EXCEEDED:
            return None
        raise
    finally:
        done.set()
        stream.cancel()
    return None
