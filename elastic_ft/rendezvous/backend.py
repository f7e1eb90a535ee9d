"""torch's ``RendezvousBackend`` on etcd v3: the rendezvous state as one key.

The state of run ``R`` is the key ``<key_prefix>/R/state``; its fencing token is
the key's ``mod_revision``. ``set_state`` is a single etcd transaction: compare
the revision (or, without a token, that the key does not exist), put and read
back on success, read on failure. So two agents can never both believe they
wrote, and a loser always gets the winner's state to merge with.

The key is attached to the writing client's lease (see
:class:`~elastic_ft.rendezvous.etcd.EtcdClient`): it lives while agents
keep writing heartbeats and expires ``lease_ttl`` seconds after the last one, so
abandoned runs do not pile up in etcd.

The value is authenticated with the job's key (:mod:`~elastic_ft.rendezvous.state_codec`):
a value that does not verify (damaged, forged, another job's or an older
version's) is refused with one line naming the key, never handed to torch,
which would unpickle it.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from .etcd import EtcdClient, EtcdClientError, KeyValue
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
            current, _ = self._client.get(self._key)
        except EtcdClientError as exc:
            raise connection_error(exc) from exc
        return None if current is None else (self._decode(current), current.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class.

        A token that is not an etcd revision (not an integer in etcd's range)
        cannot match the key's revision: it is stale, and, as torch's own
        backends do, the current state and token are returned with ``False``.
        """
        revision: int | None = None
        if token is not None:
            revision = _revision(token)
            if revision is None:
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            written, current = self._client.compare_and_put(
                self._key, self.codec.encode(state), revision
            )
        except EtcdClientError as exc:
            raise connection_error(exc) from exc
        if current is None:
            # The compare failed and the key is gone (expired or deleted between
            # our read and write): there is no state to return.
            return None
        # On success the client hands back what we wrote; no need to decode it.
        return (state if written else self._decode(current)), current.mod_revision, written

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
