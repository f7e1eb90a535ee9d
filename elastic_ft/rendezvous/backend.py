"""torch's ``RendezvousBackend`` on etcd v3: the rendezvous state as one key.

The state of run ``R`` is the key ``<key_prefix>/R/state``; its fencing token is
the key's ``mod_revision``. ``set_state`` is a single etcd transaction: compare
the revision (or, without a token, that the key does not exist), put and read
back on success, read on failure. So two agents can never both believe they
wrote, and a loser always gets the winner's state to merge with.

The key is attached to the writing client's lease (see
:class:`~elastic_ft.rendezvous.etcd.EtcdClient`): it lives while agents
keep sending heartbeats (each keeps that lease alive, whoever wrote last) and
expires ``lease_ttl`` seconds after the last one, so abandoned runs do not
pile up in etcd.

With liveness keys (:meth:`EtcdV3RendezvousBackend.use_liveness_keys`, which
the handler calls; torch's contract tests use the backend without), every read
also lists the nodes' liveness keys, and a write the state holder announced as
a heartbeat alone refreshes this node's lease instead of writing the state
(:mod:`~elastic_ft.rendezvous.leased_heartbeats`).

The value is authenticated with the job's key (:mod:`~elastic_ft.rendezvous.state_codec`):
a value that does not verify (damaged, forged, another job's or an older
version's) is refused with one line naming the key, never handed to torch,
which would unpickle it.
"""

from __future__ import annotations

import time

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from .etcd import EtcdClient, EtcdClientError, KeyValue
from .etcd.lease import KeyLease
from .state_codec import StateCodec, StateSecret


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd v3, compare-and-set on the key's mod_revision.

    Args:
        client: the etcd client (shared with the store of the same run).
        run_id: the rendezvous run id; must be non-empty and contain no ``/``.
        run_prefix: the run's key prefix, ending in ``/``.
        secret: the job's secret that authenticates the state
            (:func:`~elastic_ft.rendezvous.state_codec.state_secret`); None:
            unauthenticated, the state's types checked instead.

    Raises (from both methods):
        RendezvousConnectionError: etcd did not answer within the retry window,
            or refused the request (credentials, permissions); the message names
            the endpoint and the cause is chained.
        RendezvousStateError: the state stored in etcd does not verify (see
            :mod:`~elastic_ft.rendezvous.state_codec`); the message names the key.
    """

    def __init__(
        self, client: EtcdClient, run_id: str, run_prefix: str, *, secret: StateSecret | None
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if "/" in run_id:
            raise ValueError(f"The run id {run_id!r} must not contain '/': it is part of etcd keys.")
        self._client = client
        self._key = f"{run_prefix}state"
        self.codec = StateCodec(secret, self._key)
        self._liveness: KeyLease | None = None
        self._alive_prefix: str | None = None
        self.alive: frozenset[str] | None = None
        """Names of the liveness keys found by the last read (None: no liveness keys used)."""
        self._heartbeat_expected = False
        self._state_lease = 0  # the lease the state key is attached to, as last seen
        self._state_lease_kept = 0.0

    def use_liveness_keys(self, lease: KeyLease, alive_prefix: str) -> None:
        """Read the liveness keys under ``alive_prefix`` with the state; ``lease`` is this node's.

        Its key must lie under ``alive_prefix``.
        """
        if not lease.key.startswith(alive_prefix):
            raise ValueError(f"The liveness key {lease.key!r} is not under {alive_prefix!r}.")
        self._liveness, self._alive_prefix, self.alive = lease, alive_prefix, frozenset()

    def expect_heartbeat(self, expected: bool) -> None:
        """Whether the next ``set_state`` is a change of this node's heartbeat alone: it refreshes
        this node's lease (the state key keeps its value and revision) and returns, as written,
        the state and token etcd holds now.

        Read, not the state given: torch's holder serves no read for a second after any sync,
        and a keep-alive every second would otherwise keep it from ever reading again (nor
        would a node waiting for a round see it move, as a lost compare-and-set showed it).
        """
        self._heartbeat_expected = expected

    def release_liveness(self) -> None:
        """Delete this node's liveness key now (its lease revoked), as a node that leaves."""
        if self._liveness is not None:
            try:
                self._liveness.revoke()
            except EtcdClientError as exc:
                raise connection_error(exc) from exc

    def _seen(self, keys: list[str] | None) -> None:
        if keys is not None and self._alive_prefix is not None:
            self.alive = frozenset(k[len(self._alive_prefix):] for k in keys)

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd3"

    @property
    def key(self) -> str:
        """The etcd key that holds the state."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        try:
            if self._alive_prefix is None:
                current, _ = self._client.get(self._key)
            else:
                current, keys = self._client.get_with_keys_under(self._key, self._alive_prefix)
                self._seen(keys)
        except EtcdClientError as exc:
            raise connection_error(exc) from exc
        if current is None:
            return None
        self._state_lease = current.lease
        return self._decode(current), current.mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class.

        A token that is not an etcd revision (not an integer in etcd's range)
        cannot match the key's revision: it is stale, and, as torch's own
        backends do, the current state and token are returned with ``False``.
        """
        expected, self._heartbeat_expected = self._heartbeat_expected, False
        if expected and token is not None and self._liveness is not None:
            self._heartbeat()
            current = self.get_state()
            return None if current is None else (*current, True)
        revision: int | None = None
        if token is not None:
            revision = _revision(token)
            if revision is None:
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            if self._alive_prefix is None:
                written, current = self._client.compare_and_put(self._key, self.codec.encode(state), revision)
            else:
                written, current, keys = self._client.compare_and_put_listing(
                    self._key, self.codec.encode(state), revision, self._alive_prefix
                )
                self._seen(keys)
        except EtcdClientError as exc:
            raise connection_error(exc) from exc
        if current is not None:
            self._state_lease = current.lease
        if current is None:
            # The compare failed and the key is gone (expired or deleted between
            # our read and write): there is no state to return.
            return None
        # On success the client hands back what we wrote; no need to decode it.
        return (state if written else self._decode(current)), current.mod_revision, written

    def _heartbeat(self) -> None:
        """Refresh this node's lease (its liveness key), and the state key's lease now and then.

        The state key lives on the lease of the node that last wrote it, which
        may be gone: live nodes keep that lease alive (once a quarter of its
        TTL), as their writes of the state did before heartbeats were leases.
        """
        assert self._liveness is not None
        try:
            self._liveness.refresh()
            # This node's own keys (its round's store keys) are on its client's lease, which writes kept
            # alive while heartbeats were writes.
            self._client.keep_alive()
            now = time.monotonic()
            if (self._state_lease and self._state_lease != self._client.lease_id
                    and now - self._state_lease_kept > self._client.settings.lease_ttl / 4):
                self._client.keep_lease_alive(self._state_lease)
                self._state_lease_kept = now
        except EtcdClientError as exc:
            raise connection_error(exc) from exc

    def _decode(self, current: KeyValue) -> bytes:
        return self.codec.decode(current.value)


_MAX_REVISION = 2**63 - 1  # etcd revisions are int64


def _revision(token: Token) -> int | None:
    """The etcd revision ``token`` stands for, or ``None`` if it cannot be one."""
    if isinstance(token, bool):
        return None
    try:
        revision = int(token)
    except (TypeError, ValueError, OverflowError):
        return None
    return revision if 0 <= revision <= _MAX_REVISION else None


def connection_error(exc: EtcdClientError) -> RendezvousConnectionError:
    """torch's error for a failed etcd call; the client's message already names
    the endpoint(s) and what to do."""
    return RendezvousConnectionError(f"The etcd3 rendezvous backend failed: {exc}")
