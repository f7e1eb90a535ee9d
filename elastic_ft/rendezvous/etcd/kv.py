"""Key/value requests on one session: build etcd's messages, read its answers.

Pure request/response mapping, no retries (the failover layer wraps these).
Keys are ``str`` (UTF-8 on the wire), values ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from . import wire


MAX_TXN_OPS = 128
"""The most operations this client puts in one etcd transaction: etcd's default
``--max-txn-ops``, above which it refuses the whole transaction ("too many operations in
txn request"). Reads and writes of more keys (one per node for torch's rank assignment,
up to 512 nodes) go in chunks of this many."""

_T = TypeVar("_T")


def _chunks(items: Sequence[_T]) -> list[Sequence[_T]]:
    """``items`` in runs of at most :data:`MAX_TXN_OPS`; no items are one empty run (one
    transaction still, which reads the store's revision)."""
    return [items[start:start + MAX_TXN_OPS] for start in range(0, max(len(items), 1), MAX_TXN_OPS)]


@dataclass(frozen=True)
class KeyValue:
    """A key's value and the revision of its last modification (its fencing token)."""

    value: bytes
    mod_revision: int
    lease: int = 0
    """The lease the key is attached to (0: none)."""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``.

    etcd's rule: increment the last byte below 0xff, dropping the 0xff bytes
    after it; a prefix of only 0xff bytes (or empty) ranges to the end, ``b"\\0"``.
    """
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _range(key: str, **fields: Any) -> Any:
    return wire.message("RangeRequest", key=key.encode(), **fields)


def _prefix_range(prefix: str, **flags: bool) -> Any:
    return _range(prefix, range_end=prefix_end(prefix.encode()), **flags)


def _put_op(key: str, value: bytes, lease_id: int | None) -> Any:
    put = wire.message("PutRequest", key=key.encode(), value=value, lease=lease_id or 0)
    return wire.message("RequestOp", request_put=put)


def _first(kvs: Sequence[Any]) -> KeyValue | None:
    return KeyValue(kvs[0].value, kvs[0].mod_revision, int(kvs[0].lease)) if kvs else None


def get(session: Any, key: str) -> tuple[KeyValue | None, int]:
    """``key``'s value (or ``None``) and the store revision it was read at."""
    response = session.call(wire.RANGE, _range(key))
    return _first(response.kvs), response.header.revision


def get_many(session: Any, keys: Sequence[str]) -> tuple[list[KeyValue | None], int]:
    """Several keys read in transactions of at most :data:`MAX_TXN_OPS` reads: their values
    (or ``None``) and the revision of the first transaction, the lowest they were read at.

    Up to :data:`MAX_TXN_OPS` keys are read at one revision; beyond, each chunk at its own.
    A watch from the returned revision + 1 still misses no put: a key read missing in a
    later chunk was not there at that chunk's revision either, so its put came after it.
    """
    values: list[KeyValue | None] = []
    revisions = []
    for chunk in _chunks(keys):
        ops = [wire.message("RequestOp", request_range=_range(k)) for k in chunk]
        response = session.call(wire.TXN, wire.message("TxnRequest", success=ops))
        values += [_first(op.response_range.kvs) for op in response.responses]
        revisions.append(response.header.revision)
    return values, min(revisions)


def get_with_keys(session: Any, key: str, prefix: str) -> tuple[KeyValue | None, list[str]]:
    """``key``'s value (or ``None``) and the keys under ``prefix`` (values not read), in one transaction."""
    ops = [wire.message("RequestOp", request_range=_range(key)),
           wire.message("RequestOp", request_range=_prefix_range(prefix, keys_only=True))]
    response = session.call(wire.TXN, wire.message("TxnRequest", success=ops))
    return _first(response.responses[0].response_range.kvs), _keys(response.responses[1].response_range)


def _keys(response_range: Any) -> list[str]:
    return [kv.key.decode() for kv in response_range.kvs]


def put_many(session: Any, items: Sequence[tuple[str, bytes]], lease_id: int | None) -> None:
    """Several keys written in transactions of at most :data:`MAX_TXN_OPS` puts, in order,
    attached to ``lease_id`` if given. Atomic only up to :data:`MAX_TXN_OPS` keys: a reader
    may see the first chunks before the rest (no caller needs more; see ``EtcdStore.multi_set``)."""
    for chunk in _chunks(items):
        session.call(wire.TXN, wire.message("TxnRequest", success=[_put_op(k, v, lease_id) for k, v in chunk]))


def compare_and_put(
    session: Any, key: str, value: bytes, mod_revision: int | None, lease_id: int
) -> tuple[bool, KeyValue | None]:
    """Put ``key`` only if its mod revision is ``mod_revision`` (``None``: only if absent).

    One transaction: compare, then put on success or read on failure. Returns
    whether the put happened and the key's value now (``None`` if absent).
    """
    written, current, _ = compare_and_put_listing(session, key, value, mod_revision, lease_id, None)
    return written, current


def compare_and_put_listing(
    session: Any, key: str, value: bytes, mod_revision: int | None, lease_id: int, prefix: str | None
) -> tuple[bool, KeyValue | None, list[str] | None]:
    """:func:`compare_and_put`, which on failure also lists the keys under ``prefix`` (if given)
    in the same transaction: the third item (``None`` on success or without ``prefix``)."""
    if mod_revision is None:
        compare = wire.message(
            "Compare", result=wire.COMPARE_EQUAL, target=wire.TARGET_CREATE, key=key.encode(), create_revision=0
        )
    else:
        compare = wire.message(
            "Compare", result=wire.COMPARE_EQUAL, target=wire.TARGET_MOD, key=key.encode(), mod_revision=mod_revision
        )
    request = wire.message(
        "TxnRequest",
        compare=[compare],
        success=[_put_op(key, value, lease_id)],
        failure=[wire.message("RequestOp", request_range=_range(key))]
        + ([] if prefix is None else [wire.message("RequestOp", request_range=_prefix_range(prefix, keys_only=True))]),
    )
    response = session.call(wire.TXN, request)
    if response.succeeded:
        # The put's revision is the transaction's: no need to read back the
        # value we just wrote (it is the biggest part of the reply).
        return True, KeyValue(value, response.header.revision, lease_id), None
    listed = None if prefix is None else _keys(response.responses[1].response_range)
    return False, _first(response.responses[0].response_range.kvs), listed


def delete(session: Any, key: str) -> bool:
    """Delete ``key``; whether it existed."""
    request = wire.message("DeleteRangeRequest", key=key.encode())
    return session.call(wire.DELETE_RANGE, request).deleted > 0


def delete_prefix(session: Any, prefix: str) -> int:
    """Delete every key under ``prefix``; how many there were."""
    raw = prefix.encode()
    request = wire.message("DeleteRangeRequest", key=raw, range_end=prefix_end(raw))
    return int(session.call(wire.DELETE_RANGE, request).deleted)


def count_prefix(session: Any, prefix: str) -> int:
    """How many keys are under ``prefix`` (values not read)."""
    return int(session.call(wire.RANGE, _prefix_range(prefix, count_only=True)).count)


def keys_under(session: Any, prefix: str) -> list[str]:
    """The keys under ``prefix`` in byte order (values not read)."""
    return _keys(session.call(wire.RANGE, _prefix_range(prefix, keys_only=True)))
