"""A ``torch.distributed.Store`` on etcd v3, for the rendezvous handler and agent.

torch's dynamic rendezvous hands the agent a store for bootstrapping each round:
rank 0 publishes MASTER_ADDR/MASTER_PORT, agents exchange their local world
sizes and assigned ranks, and meet at the exit barrier. With the c10d backend
that store is a TCPStore hosted by one agent, which takes the whole job down if
that node is reclaimed; this one lives in etcd, so any node may vanish.

Keys live under ``<key_prefix>/<run_id>/store/`` and are attached to the
writer's lease, so they expire with the run. Semantics follow TCPStore:
``get``/``multi_get``/``wait`` block until the keys exist (up to the store
timeout) and raise ``DistStoreError`` ("Wait timeout ...") on timeout; blocking
uses an etcd watch, not polling. ``add``, ``append`` and ``compare_set`` are
compare-and-swap loops on the key's revision, bounded in attempts and time.
Values are bytes; counters are stored as decimal text, as TCPStore does.

The store is called from Python and from C++: behind torch's ``PrefixStore``
(which the rendezvous handler wraps it in) torch's C++ trampoline for Python
stores calls ``set``, ``get``, ``add``, ``check``, ``compare_set``, ``wait``,
``append``, ``multi_get``, ``multi_set``, ``has_extended_api`` and ``clone`` by
those names, but ``num_keys`` and ``delete_key`` by their C++ names
``getNumKeys`` and ``deleteKey``; this class answers to both. torch 2.13 does
not forward ``list_keys`` (nor the queue calls) from C++ to a Python store, so
``list_keys`` works only when called on this store directly.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

from .etcd import EtcdClient, EtcdClientError, KeyValue


class WritersLostError(dist.DistStoreError):
    """A blocking wait ended early: the node that should write the key left the rendezvous.

    Met in the handler's own round (it starts another) or in torch's agent while it assigns
    ranks right after a round (:mod:`~elastic_ft.rendezvous.agent_rounds`: another round too).
    """

CAS_MAX_ATTEMPTS = 1000
"""Compare-and-swap attempts on one key before giving up. Every lost attempt is
another writer's success, so a key written once by each of N agents (a
barrier's counter) needs at most N: this covers a barrier of 1000 agents, and
otherwise only a writer stuck in a loop exhausts it."""

_CAS_BACKOFF_MAX_S = 0.05
"""Longest random pause after a lost attempt, spreading out writers that collide."""

# What a compare-and-swap step decides from the key's current value (None: no
# key): the value to write (None: write nothing) and what the call returns.
_Decision = Callable[[bytes | None], tuple[bytes | None, bytes]]


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
            ``multi_get``); ``set_timeout`` changes it, as on any store. It
            also bounds the time one compare-and-swap call may keep losing.
        cas_max_attempts: attempts of one ``add``/``append``/``compare_set``
            before it gives up (see :data:`CAS_MAX_ATTEMPTS`).

    Raises:
        torch.distributed.DistStoreError: a blocking call timed out ("Wait
            timeout ...", naming the keys and the prefix), a compare-and-swap
            lost every attempt (naming the key and the count), or etcd failed
            (unreachable past the retry window, permission denied); the
            message names the keys or the endpoint, the cause is chained.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta = timedelta(seconds=300),
        *,
        cas_max_attempts: int = CAS_MAX_ATTEMPTS,
    ) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"The store key prefix {prefix!r} must end with '/'.")
        if cas_max_attempts < 1:
            raise ValueError(f"cas_max_attempts ({cas_max_attempts}) must be at least 1.")
        self._client = client
        self._prefix = prefix
        self._cas_max_attempts = cas_max_attempts
        # Clones handed to torch's C++ side; see clone().
        self._clones: list[EtcdStore] = []
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

    def _wait_for_keys(self, keys: Sequence[str], deadline: float) -> list[KeyValue | None]:
        """The client's wait for ``keys`` until ``deadline`` (``None`` for those
        still missing then), in slices between writer checks."""
        full = [self._key(k) for k in keys]
        if self._writer_check is None:
            return self._client.wait_for_keys(full, deadline)
        check, interval = self._writer_check
        found: dict[str, KeyValue] = {}
        while True:
            # A key seen once counts as there: only the missing ones are waited for again.
            missing = [k for k in full if k not in found]
            values = self._client.wait_for_keys(missing, min(deadline, time.monotonic() + interval))
            found.update((k, v) for k, v in zip(missing, values) if v is not None)
            if all(k in found for k in full) or time.monotonic() >= deadline:
                return [found.get(k) for k in full]
            reason = check()
            if reason is None:
                continue
            missing = [k for k in full if k not in found]
            # They may have landed while we checked.
            found.update((k, v) for k, v in zip(missing, self._client.get_many(missing)) if v is not None)
            if all(k in found for k in full):
                return [found.get(k) for k in full]
            lost = next(k for k in full if k not in found)[len(self._prefix):]
            raise WritersLostError(
                f"The etcd store ({self._prefix}) stopped waiting for the key {lost!r}: {reason}; "
                f"its writer will not come back to this round."
            )

    def _run(self, what: str, fn):  # type: ignore[no-untyped-def]
        try:
            return fn()
        except EtcdClientError as exc:
            raise dist.DistStoreError(
                f"The etcd store ({self._prefix}) could not {what}: {exc}"
            ) from exc

    # -- the store itself -------------------------------------------------------

    def clone(self) -> EtcdStore:
        """A new store on the same keys, sharing this one's (thread-safe) client.

        torch's C++ side calls it (``PrefixStore.clone``, process-group
        splits) and keeps the result only in C++. pybind keeps the Python half
        of a Python store alive only while Python holds a reference; without
        one every later call on the clone fails with "Not implemented". So
        this store holds a reference to each of its clones.
        """
        twin = EtcdStore(
            self._client, self._prefix, self.timeout, cas_max_attempts=self._cas_max_attempts
        )
        twin._writer_check = self._writer_check
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are implemented."""
        return True

    # -- writes -----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._run("set a key", lambda: self._client.put_many([(self._key(key), _to_bytes(value))]))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set every key, in etcd transactions of at most 128 keys (etcd's default limit,
        :data:`~elastic_ft.rendezvous.etcd.kv.MAX_TXN_OPS`).

        Atomic up to 128 keys: a reader of more may see the first 128 before the rest.
        torch's caller needs no more: rank 0 writes each agent's assigned ranks, and each
        agent waits for its own key only.
        """
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; they must match."
            )
        items = [(self._key(k), _to_bytes(v)) for k, v in zip(keys, values)]
        self._run("set keys", lambda: self._client.put_many(items))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (a missing key counts as 0); returns the sum.

        Raises:
            ValueError: the key holds something other than a decimal integer.
        """

        def decide(current: bytes | None) -> tuple[bytes, bytes]:
            new = str(_counter(key, current) + int(amount)).encode()
            return new, new

        return int(self._compare_and_swap(key, decide).decode())

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the key's bytes, creating the key if it is missing."""
        suffix = _to_bytes(value)

        def decide(current: bytes | None) -> tuple[bytes, bytes]:
            new = (current or b"") + suffix
            return new, new

        self._compare_and_swap(key, decide)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``.

        As in TCPStore: a missing key counts as holding ``b""``. Returns the
        value the key holds afterwards, or ``expected_value`` when the key is
        missing and ``expected_value`` is not empty.
        """
        expected = _to_bytes(expected_value)
        desired = _to_bytes(desired_value)

        def decide(current: bytes | None) -> tuple[bytes | None, bytes]:
            if current is None and expected:
                return None, expected
            if current is not None and current != expected:
                return None, current
            return desired, desired

        return self._compare_and_swap(key, decide)

    def _compare_and_swap(self, key: str, decide: _Decision) -> bytes:
        """Read ``key``, ``decide`` what to write, and write it only if the key is
        unchanged since the read; on a lost race decide again on the winner's value.

        Bounded: at most ``cas_max_attempts`` writes and the store timeout;
        then a ``DistStoreError`` naming the key and the count. Nothing is
        written by a failed call.
        """
        full = self._key(key)
        current, _ = self._run("read a key", lambda: self._client.get(full))
        started = time.monotonic()
        attempts = 0
        while True:
            new, result = decide(None if current is None else current.value)
            if new is None:
                return result
            revision = None if current is None else current.mod_revision
            attempts += 1
            written, current = self._run(
                "compare-and-set a key", lambda: self._client.compare_and_put(full, new, revision)
            )
            if written:
                return result
            elapsed = time.monotonic() - started
            if attempts >= self._cas_max_attempts or elapsed >= self.timeout.total_seconds():
                raise dist.DistStoreError(
                    f"The etcd store ({self._prefix}) gave up changing the key {key!r} after "
                    f"{attempts} compare-and-swap attempts in {elapsed:.1f} s: another writer "
                    f"changed it between every read and write. Too many agents write it at "
                    f"once, or one rewrites it in a loop."
                )
            # Another writer won this round: pause a little (random, growing)
            # so that colliding writers spread out, then judge its value.
            time.sleep(random.uniform(0, min(_CAS_BACKOFF_MAX_S, 0.001 * 2**attempts)))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""
        return self._run("delete a key", lambda: self._client.delete(self._key(key)))

    def deleteKey(self, key: str) -> bool:  # noqa: N802 (torch's C++ name)
        """``delete_key`` under the name torch's C++ ``PrefixStore`` calls it by."""
        return self.delete_key(key)

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
        """How many keys the store holds (every key under its prefix)."""
        return self.num_keys_under("")

    def num_keys_under(self, key_prefix: str) -> int:
        """How many keys start with ``key_prefix`` (without the store's prefix); one
        etcd request whatever their number, values not read."""
        return self._run("count keys", lambda: self._client.count_prefix(self._key(key_prefix)))

    def getNumKeys(self) -> int:  # noqa: N802 (torch's C++ name)
        """``num_keys`` under the name torch's C++ ``PrefixStore`` calls it by."""
        return self.num_keys()

    def list_keys(self) -> list[str]:
        """Every key in the store (without the prefix), in byte order."""
        keys = self._run("list keys", lambda: self._client.keys_under(self._prefix))
        return [k[len(self._prefix) :] for k in keys]

    def _wait_all(self, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        found = self._run("wait for keys", lambda: self._wait_for_keys(keys, deadline))
        if any(f is None for f in found):
            raise self._wait_timeout(keys, timeout)
        return [f.value for f in found]  # type: ignore[union-attr]

    def _wait_timeout(self, keys: Sequence[str], timeout: timedelta) -> dist.DistStoreError:
        """The error of a wait that timed out, worded as torch's stores word it
        ("Wait timeout"), naming the keys still missing and the etcd prefix."""
        try:
            values = self._client.get_many([self._key(k) for k in keys])
            missing = [k for k, v in zip(keys, values) if v is None] or list(keys)
        except EtcdClientError:
            missing = list(keys)  # etcd went away too; name every key waited for
        return dist.DistStoreError(
            f"Wait timeout after {round(timeout.total_seconds() * 1000)}ms, keys: "
            f"{', '.join(missing)} ({len(missing)} of {len(keys)} missing under the etcd "
            f"prefix {self._prefix} at {self._client.endpoint}). The agent that should "
            f"write them is probably gone."
        )


def _counter(key: str, value: bytes | None) -> int:
    """The integer a counter key holds (a missing or empty key holds 0)."""
    if not value:
        return 0
    try:
        return int(value.decode())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(
            f"The etcd store key {key!r} holds {value[:40]!r}, not a decimal integer; "
            f"add() works only on counters."
        ) from None
