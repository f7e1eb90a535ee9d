"""A ``torch.distributed.Store`` on etcd v3, for the rendezvous handler and agent.

torch's dynamic rendezvous hands the agent a store for bootstrapping each round:
rank 0 publishes MASTER_ADDR/MASTER_PORT, agents exchange their local world
sizes and assigned ranks, and meet at the exit barrier. With the c10d backend
that store is a TCPStore hosted by one agent, which takes the whole job down if
that node is reclaimed; this one lives in etcd, so any node may vanish.

Keys live under ``<key_prefix>/<run_id>/store/`` and are attached to the
writer's lease, so they expire with the run. Semantics follow TCPStore:
``get``/``multi_get``/``wait`` block until the keys exist (up to the store
timeout) and raise ``DistStoreError`` on timeout; blocking uses an etcd watch,
not polling. ``add`` and ``compare_set`` are compare-and-swap loops on the
key's revision. Values are bytes; counters are stored as decimal text, as
TCPStore does.

``delete_key`` and ``num_keys`` work when called from Python; torch 2.13's C++
``PrefixStore`` does not forward them to Python stores (it raises "pure virtual
function"), and nothing in torch's agent path calls them through it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

from .etcd_client import EtcdClient, EtcdClientError, KeyValue


class WritersLostError(dist.DistStoreError):
    """A blocking wait ended early: the node that should write the key left the rendezvous."""


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    """A c10d store whose keys live in etcd under ``prefix``.

    Args:
        client: the etcd client (the backend of the same run may share it).
        prefix: key prefix, ending in ``/``; every key is ``prefix + key``.
        timeout: default timeout of the blocking calls (``get``, ``wait``,
            ``multi_get``); ``set_timeout`` changes it, as on any store.

    Raises:
        torch.distributed.DistStoreError: a blocking call timed out, or etcd
            failed (unreachable past the retry window, permission denied);
            the message names the keys or the endpoint, the cause is chained.
    """

    def __init__(
        self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"The store key prefix {prefix!r} must end with '/'.")
        self._client = client
        self._prefix = prefix
        self._writer_check: tuple[Callable[[], str | None], float] | None = None
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def client(self) -> EtcdClient:
        """The etcd client this store (and the run's backend) uses."""
        return self._client

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set_writer_check(self, check: Callable[[], str | None], interval: float) -> None:
        """End blocking waits early when the nodes that should write the keys are gone.

        Every ``interval`` seconds that a wait goes without its key, ``check()``
        is asked; a reason (not ``None``) ends the wait with
        :class:`WritersLostError` naming it, unless the key has landed
        meanwhile. The rendezvous handler installs it: a key of a node that
        left the rendezvous will never come, and the store's own timeout (300 s)
        is far too long to notice. ``check`` must not raise.
        """
        if interval <= 0:
            raise ValueError(f"The writer check interval ({interval}) must be positive.")
        self._writer_check = (check, interval)

    def _wait_for_key(self, key: str, deadline: float) -> KeyValue | None:
        """The client's wait for ``key`` until ``deadline``, in slices between writer checks."""
        full = self._key(key)
        if self._writer_check is None:
            return self._client.wait_for_key(full, deadline)
        check, interval = self._writer_check
        while True:
            found = self._client.wait_for_key(full, min(deadline, time.monotonic() + interval))
            if found is not None or time.monotonic() >= deadline:
                return found
            reason = check()
            if reason is None:
                continue
            found, _ = self._client.get(full)  # it may have landed while we checked
            if found is not None:
                return found
            raise WritersLostError(
                f"The etcd store ({self._prefix}) stopped waiting for the key {key!r}: {reason}; "
                f"its writer will not come back to this round."
            )

    def _run(self, what: str, fn):  # type: ignore[no-untyped-def]
        try:
            return fn()
        except EtcdClientError as exc:
            raise dist.DistStoreError(
                f"The etcd store ({self._prefix}) could not {what}: {exc}"
            ) from exc

    # -- writes -----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._run("set a key", lambda: self._client.put_many([(self._key(key), _to_bytes(value))]))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; they must match."
            )
        items = [(self._key(k), _to_bytes(v)) for k, v in zip(keys, values)]
        self._run("set keys", lambda: self._client.put_many(items))

    def add(self, key: str, amount: int) -> int:
        def update(current: bytes | None) -> bytes:
            base = 0 if current is None else int(current.decode() or "0")
            return str(base + int(amount)).encode()

        return int(self._update(key, update).decode())

    def append(self, key: str, value: str | bytes) -> None:
        suffix = _to_bytes(value)
        self._update(key, lambda current: (current or b"") + suffix)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``.

        As in TCPStore: a missing key counts as holding ``b""``. Returns the
        value the key holds afterwards, or ``expected_value`` when the key is
        missing and ``expected_value`` is not empty.
        """
        expected = _to_bytes(expected_value)
        desired = _to_bytes(desired_value)
        full = self._key(key)
        while True:
            current, _ = self._run("read a key", lambda: self._client.get(full))
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            revision = None if current is None else current.mod_revision
            written, now = self._run(
                "compare-and-set a key",
                lambda: self._client.compare_and_put(full, desired, revision),
            )
            if written:
                return desired
            # Someone else changed the key between our read and write: judge again.

    def _update(self, key: str, fn) -> bytes:  # type: ignore[no-untyped-def]
        """Read-modify-write ``key`` with ``fn(old or None) -> new``, retried on conflict."""
        full = self._key(key)
        current, _ = self._run("read a key", lambda: self._client.get(full))
        while True:
            new = fn(None if current is None else current.value)
            revision = None if current is None else current.mod_revision
            written, current = self._run(
                "update a key", lambda: self._client.compare_and_put(full, new, revision)
            )
            if written:
                return new

    def delete_key(self, key: str) -> bool:
        return self._run("delete a key", lambda: self._client.delete(self._key(key)))

    # -- reads ----------------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self._wait_all([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait_all(keys, None)
        values = self._run(
            "read keys", lambda: self._client.get_many([self._key(k) for k in keys])
        )
        missing = [k for k, v in zip(keys, values) if v is None]
        if missing:
            # Only a concurrent delete_key can get here.
            raise dist.DistStoreError(
                f"The etcd store keys {missing} ({self._prefix}) were deleted while being read."
            )
        return [v.value for v in values]  # type: ignore[union-attr]

    def check(self, keys: list[str]) -> bool:
        values = self._run(
            "read keys", lambda: self._client.get_many([self._key(k) for k in keys])
        )
        return all(v is not None for v in values)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_all(keys, timeout)

    def num_keys(self) -> int:
        return self._run("count keys", lambda: self._client.count_prefix(self._prefix))

    def _wait_all(self, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        values = []
        for key in keys:
            found = self._run(
                "wait for a key", lambda: self._wait_for_key(key, deadline)
            )
            if found is None:
                missing = [k for k in keys if not self.check([k])]
                raise dist.DistStoreError(
                    f"Timed out after {timeout.total_seconds():g} s waiting for the keys "
                    f"{missing} in the etcd store {self._prefix} at {self._client.endpoint}. "
                    f"The agent that should write them is probably gone."
                )
            values.append(found.value)
        return values
