"""This client's lease: every key it writes is attached to it.

The keys of a run whose agents are all gone expire ``lease_ttl`` seconds after
the last write. Live agents keep the lease alive: a write, or a heartbeat
(:meth:`~elastic_ft.rendezvous.etcd.EtcdClient.keep_alive`: heartbeats are
liveness leases, not writes, see :class:`KeyLease`), refreshes it (one
keep-alive) when it is older than a quarter of the TTL, which bounds the extra
calls. A lease that expired anyway (etcd down longer than the TTL) is replaced
once per write.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, TypeVar

from . import wire
from .errors import EtcdClientError, EtcdLeaseError, LeaseGone, is_lease_not_found
from .failover import Failover

log = logging.getLogger(__name__)

T = TypeVar("T")


def keep_alive(session: Any, lease_id: int) -> int:
    """One LeaseKeepAlive of ``lease_id`` on ``session``: its TTL now, 0 or less if it is gone."""
    request = wire.message("LeaseKeepAliveRequest", ID=lease_id)
    responses = list(session.responses(wire.LEASE_KEEP_ALIVE, request))
    return int(responses[-1].TTL) if responses else 0


def revoke(failover: Failover, lease_id: int) -> None:
    """Revoke ``lease_id`` now, deleting every key attached to it."""
    request = wire.message("LeaseRevokeRequest", ID=lease_id)
    failover.call("lease revoke", lambda s: s.call(wire.LEASE_REVOKE, request))


class Lease:
    """The lease of the client that owns ``failover``, granted on first use."""

    def __init__(self, failover: Failover) -> None:
        self._failover = failover
        self._id: int | None = None
        self._refreshed_at = 0.0

    @property
    def id(self) -> int | None:
        """The lease attached to this client's writes, if one was granted yet."""
        return self._id

    def current(self, session: Any) -> int:
        """The lease id, granted or refreshed on ``session`` as needed.

        Raises:
            LeaseGone: the server no longer has our lease.
        """
        ttl = self._failover.settings.lease_ttl
        now = time.monotonic()
        with self._failover.lock:
            if self._id is None:
                response = session.call(wire.LEASE_GRANT, wire.message("LeaseGrantRequest", TTL=ttl))
                self._id = int(response.ID)
                self._refreshed_at = now
            elif now - self._refreshed_at > ttl / 4:
                if keep_alive(session, self._id) <= 0:
                    raise LeaseGone()
                self._refreshed_at = now
            return self._id

    def call(self, what: str, fn: Callable[[Any, int], T]) -> T:
        """``fn(session, lease_id)`` with retries, granting a new lease once if ours expired."""
        for _ in range(2):
            try:
                return self._failover.call(what, lambda session: fn(session, self.current(session)))
            except (LeaseGone, EtcdClientError) as exc:
                if not (isinstance(exc, LeaseGone) or is_lease_not_found(exc.__cause__)):
                    raise
                log.warning("The etcd lease of %r expired; granting a new one.", self._failover.name)
                with self._failover.lock:
                    self._id = None
        raise EtcdLeaseError(
            f"etcd {what} failed twice because the lease granted by {self._failover.endpoint} "
            f"expired at once; check the lease_ttl option ({self._failover.settings.lease_ttl} s)."
        )

    def remaining_ttl(self, lease_id: int) -> int:
        """Seconds left on ``lease_id``; -1 if it does not exist (expired or revoked)."""
        request = wire.message("LeaseTimeToLiveRequest", ID=lease_id)
        return self._failover.call("lease", lambda s: int(s.call(wire.LEASE_TIME_TO_LIVE, request).TTL))

    def revoke(self) -> None:
        """Revoke the lease now, deleting every key attached to it."""
        with self._failover.lock:
            lease_id, self._id = self._id, None
        if lease_id is not None:
            revoke(self._failover, lease_id)


class KeyLease:
    """One key that exists while its holder refreshes it: a short lease of its own, kept alive
    by :meth:`refresh` (one LeaseKeepAlive: no write, no new etcd revision).

    The first refresh grants the lease and puts the key on it (one write); so does a refresh
    that finds the lease gone (expired, revoked, or etcd lost its data). Every call goes
    through the failover layer's bounded retries.

    Args:
        failover: the client's connection.
        key: the key kept alive.
        ttl: the lease's time to live, in seconds (etcd may raise it to its minimum).
    """

    def __init__(self, failover: Failover, key: str, ttl: int) -> None:
        if ttl < 1:
            raise ValueError(f"The lease TTL of {key!r} ({ttl} s) must be at least 1 s.")
        self._failover = failover
        self.key = key
        self.ttl = ttl
        self._id: int | None = None

    def refresh(self) -> None:
        """Keep the key alive for another ``ttl`` seconds, (re)creating it if its lease is gone."""
        self._failover.call("lease keep-alive", self._refresh)

    def _refresh(self, session: Any) -> None:
        from .kv import put_many

        lease_id = self._id
        if lease_id is not None:
            if keep_alive(session, lease_id) > 0:
                return
            log.info("The etcd lease of %s is gone (expired or etcd lost it); granting a new one.", self.key)
        response = session.call(wire.LEASE_GRANT, wire.message("LeaseGrantRequest", TTL=self.ttl))
        lease_id = int(response.ID)
        put_many(session, [(self.key, b"")], lease_id)
        self._id = lease_id

    def revoke(self) -> None:
        """Revoke the lease now, deleting the key (no-op if none was granted)."""
        lease_id, self._id = self._id, None
        if lease_id is not None:
            revoke(self._failover, lease_id)
