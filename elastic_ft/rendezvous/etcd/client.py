"""The one interface between elastic_ft and etcd: :class:`EtcdClient`.

Everything else in :mod:`elastic_ft.rendezvous` talks to etcd through it: read
one or many keys, write many keys, one compare-and-put transaction, delete,
count, wait for keys through a watch, and a lease that keeps written keys
alive while this process writes. It composes the modules of this package:
:mod:`.failover` (sessions, retries, outages), :mod:`.kv`, :mod:`.watch` and
:mod:`.lease`.
"""

from __future__ import annotations

from typing import Sequence

from . import kv, watch, wire
from .failover import Failover, Outage
from .kv import KeyValue
from .lease import KeyLease, Lease, keep_alive
from .settings import ConnectionSettings, Endpoint


class EtcdClient:
    """A small, thread-safe etcd v3 client with failover, retries and one lease.

    Args:
        settings: endpoints, TLS, credentials, timeouts and lease TTL.
        name: a label for log and error messages (the run id).

    Nothing connects until the first call (or :meth:`open`). Every method
    raises :class:`~.errors.EtcdUnavailableError` once ``retry_timeout``
    seconds of transient faults have passed, and
    :class:`~.errors.EtcdClientError` at once for faults that retrying cannot
    fix (bad credentials, permission denied; a TLS mismatch shows up as
    unavailable and is retried, then named).
    """

    def __init__(self, settings: ConnectionSettings, name: str = "") -> None:
        self._failover = Failover(settings, name)
        self._lease = Lease(self._failover)

    @property
    def settings(self) -> ConnectionSettings:
        return self._failover.settings

    @property
    def endpoint(self) -> Endpoint:
        """The member currently in use."""
        return self._failover.endpoint

    @property
    def last_outage(self) -> Outage | None:
        """The latest run of transient failures that etcd has since ended by answering.

        ``None`` while none has happened (or while the first one lasts). Used
        by the rendezvous to give nodes time to send heartbeats again before
        it counts them as dead.
        """
        return self._failover.last_outage

    def open(self) -> None:
        """Connect and grant this client's lease now, under the usual retries.

        The rendezvous handler calls it when it is built, as torch's c10d
        backend connects its TCPStore client then: a wrong endpoint or
        credentials fail at start, and the first rendezvous round does not
        pay for the connection and the lease grant while every node races.
        """
        self._failover.call("connect", self._lease.current)

    def close(self) -> None:
        """Close the connection; the client reconnects if used again."""
        self._failover.drop(failover=False)

    def server_version(self) -> str:
        """The etcd version of the member in use (etcd's Maintenance/Status call), e.g. ``3.4.30``."""
        request = wire.message("StatusRequest")
        return self._failover.call("status", lambda s: str(s.call(wire.STATUS, request).version))

    # -- key/value -------------------------------------------------------------

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        """Read ``key``; returns its value (or ``None``) and the store revision read at."""
        return self._failover.call("get", lambda s: kv.get(s, key))

    def get_many(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Read several keys: one transaction (one revision) per :data:`~.kv.MAX_TXN_OPS` keys."""
        return self._read_many(keys)[0] if keys else []

    def _read_many(self, keys: Sequence[str]) -> tuple[list[KeyValue | None], int]:
        """Values of ``keys`` and the (lowest) store revision read at; one key is one plain read."""
        if len(keys) == 1:
            value, revision = self.get(keys[0])
            return [value], revision
        return self._failover.call("get", lambda s: kv.get_many(s, keys))

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: bool = True) -> None:
        """Write several keys, attached to this client's lease: one transaction per
        :data:`~.kv.MAX_TXN_OPS` keys, so atomic only up to that many."""
        if not items:
            return
        if lease:
            self._lease.call("put", lambda s, lease_id: kv.put_many(s, items, lease_id))
        else:
            self._failover.call("put", lambda s: kv.put_many(s, items, None))

    def compare_and_put(self, key: str, value: bytes, mod_revision: int | None) -> tuple[bool, KeyValue | None]:
        """Write ``key`` only if it is unchanged since ``mod_revision``.

        ``mod_revision=None`` means "only if the key does not exist". One etcd
        transaction. Returns whether the put happened and the key's value now
        (``None`` if it does not exist).
        """
        return self._lease.call(
            "compare-and-put", lambda s, lease_id: kv.compare_and_put(s, key, value, mod_revision, lease_id)
        )

    def get_with_keys_under(self, key: str, prefix: str) -> tuple[KeyValue | None, list[str]]:
        """Read ``key`` and list the keys under ``prefix`` (no values) in one transaction."""
        return self._failover.call("get", lambda s: kv.get_with_keys(s, key, prefix))

    def compare_and_put_listing(
        self, key: str, value: bytes, mod_revision: int | None, prefix: str
    ) -> tuple[bool, KeyValue | None, list[str] | None]:
        """:meth:`compare_and_put` that, when the compare fails, also lists the keys under
        ``prefix`` in the same transaction (third item; ``None`` when the put happened)."""
        return self._lease.call(
            "compare-and-put",
            lambda s, lease_id: kv.compare_and_put_listing(s, key, value, mod_revision, lease_id, prefix),
        )

    def delete(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""
        return self._failover.call("delete", lambda s: kv.delete(s, key))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        return self._failover.call("delete", lambda s: kv.delete_prefix(s, prefix))

    def count_prefix(self, prefix: str) -> int:
        """Count the keys under ``prefix`` without reading their values."""
        return self._failover.call("count", lambda s: kv.count_prefix(s, prefix))

    def keys_under(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, in byte order, without reading their values."""
        return self._failover.call("list", lambda s: kv.keys_under(s, prefix))

    def wait_for_keys(self, keys: Sequence[str], deadline: float) -> list[KeyValue | None]:
        """Block until every key exists, through one etcd watch; their values, in order.

        Keys still missing at ``deadline`` (a :func:`time.monotonic` value)
        are ``None``; see :mod:`.watch`.
        """
        if not keys:
            return []
        return watch.wait_for_keys(self._failover, self._read_many, keys, deadline)

    # -- lease -----------------------------------------------------------------

    @property
    def lease_id(self) -> int | None:
        """The lease attached to this client's writes, if one was granted yet."""
        return self._lease.id

    def lease_remaining_ttl(self, lease_id: int) -> int:
        """Seconds left on ``lease_id``; -1 if it does not exist (expired or revoked)."""
        return self._lease.remaining_ttl(lease_id)

    def keep_lease_alive(self, lease_id: int) -> int:
        """Refresh ``lease_id`` (any client's) once; its TTL now, 0 or less if it is gone."""
        return self._failover.call("lease keep-alive", lambda session: keep_alive(session, lease_id))

    def keep_alive(self) -> None:
        """Keep this client's own lease (its written keys) alive: one keep-alive once a quarter of
        ``lease_ttl`` at most, a new lease if it expired (see :class:`~.lease.Lease`)."""
        self._lease.call("lease keep-alive", lambda session, lease_id: lease_id)

    def key_lease(self, key: str, ttl: int) -> KeyLease:
        """A lease of its own for ``key`` with ``ttl`` seconds: the key exists while it is refreshed."""
        return KeyLease(self._failover, key, ttl)

    def revoke_lease(self) -> None:
        """Revoke this client's lease now, deleting every key attached to it."""
        self._lease.revoke()
