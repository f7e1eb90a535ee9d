"""torch's ``RendezvousBackend`` on etcd v3: the rendezvous state as one key.

The state of run ``R`` is the key ``<key_prefix>/R/state``; its fencing token is
the key's ``mod_revision``. ``set_state`` is a single etcd transaction: compare
the revision (or, without a token, that the key does not exist), put and read
back on success, read on failure. So two agents can never both believe they
wrote, and a loser always gets the winner's state to merge with.

The key is attached to the writing client's lease (see
:class:`~elastic_ft.rendezvous.etcd_client.EtcdClient`): it lives while agents
keep writing heartbeats and expires ``lease_ttl`` seconds after the last one, so
abandoned runs do not pile up in etcd.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from .etcd_client import EtcdClient, EtcdClientError, KeyValue


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd v3, compare-and-set on the key's mod_revision.

    Args:
        client: the etcd client (shared with the store of the same run).
        run_id: the rendezvous run id; must be non-empty and contain no ``/``.
        run_prefix: the run's key prefix, ending in ``/``.

    Raises (from both methods):
        RendezvousConnectionError: etcd did not answer within the retry window,
            or refused the request (credentials, permissions); the message names
            the endpoint and the cause is chained.
        RendezvousStateError: the stored token is not a revision number.
    """

    def __init__(self, client: EtcdClient, run_id: str, run_prefix: str) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if "/" in run_id:
            raise ValueError(f"The run id {run_id!r} must not contain '/': it is part of etcd keys.")
        self._client = client
        self._key = f"{run_prefix}state"

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
        return None if current is None else (current.value, current.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        revision: int | None
        if token is None:
            revision = None
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError) as exc:
                raise RendezvousStateError(
                    f"The rendezvous fencing token {token!r} is not an etcd revision number; "
                    f"it must come from get_state() or set_state() of this backend."
                ) from exc
        try:
            written, current = self._client.compare_and_put(self._key, state, revision)
        except EtcdClientError as exc:
            raise connection_error(exc) from exc
        if current is None:
            # The compare failed and the key is gone (expired or deleted between
            # our read and write): there is no state to return.
            return None
        return _as_result(current, written)


def _as_result(current: KeyValue, written: bool) -> tuple[bytes, Token, bool]:
    return current.value, current.mod_revision, written


def connection_error(exc: EtcdClientError) -> RendezvousConnectionError:
    """torch's error for a failed etcd call; the client's message already names
    the endpoint(s) and what to do."""
    return RendezvousConnectionError(f"The etcd3 rendezvous backend failed: {exc}")
