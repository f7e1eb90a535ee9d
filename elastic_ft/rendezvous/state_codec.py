"""How the rendezvous state is written in etcd, so that a damaged value is caught.

torch's dynamic rendezvous hands the backend its state as opaque bytes (a
pickle) and unpickles whatever the backend returns; a value damaged in etcd
(truncated, overwritten by hand or by another program) would surface as an
obscure unpickling error, or worse, as a wrong state. So the value in etcd is

    ``eft-state/1:`` + 16 hex digits of the state's SHA-256 + ``:`` + base64(state)

(torch's own backends store base64 too). Decoding checks the marker, the
base64 and the digest; any mismatch is a :class:`RendezvousStateError`.

Values written before this encoding existed are the raw pickle torch gave us.
They are still read: a value without the marker that has the shape of a pickle
of protocol 2 or later (first byte ``0x80`` PROTO, last byte ``.`` STOP) is
returned as it is. Anything else is corrupt. The marker cannot be mistaken for
such a pickle, nor a pickle for the marker, since their first bytes differ.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from torch.distributed.elastic.rendezvous import RendezvousStateError

MARKER = b"eft-state/1:"
_DIGEST_HEX = 16  # 64 bits of SHA-256: damage, not an adversary, is what it detects


def _digest(state: bytes) -> bytes:
    return hashlib.sha256(state).hexdigest()[:_DIGEST_HEX].encode()


def encode_state(state: bytes) -> bytes:
    """The value stored in etcd for ``state``."""
    return MARKER + _digest(state) + b":" + base64.b64encode(state)


def is_legacy_state(value: bytes) -> bool:
    """Whether ``value`` has the shape of a raw pickled state (written before the encoding)."""
    return len(value) >= 2 and value[:1] == b"\x80" and value[-1:] == b"."


def decode_state(value: bytes, key: str) -> bytes:
    """The state stored as ``value`` in the etcd key ``key``.

    Raises:
        RendezvousStateError: ``value`` is neither an intact encoded state nor
            a legacy raw pickle; the message names the key and what is wrong.
    """
    if not value.startswith(MARKER):
        if is_legacy_state(value):
            return value
        raise _corrupt(key, f"it does not start with {MARKER.decode()!r} nor look like a pickle")
    digest, sep, body = value[len(MARKER) :].partition(b":")
    if not sep or len(digest) != _DIGEST_HEX:
        raise _corrupt(key, "its header is damaged")
    try:
        state = base64.b64decode(body, validate=True)
    except binascii.Error as exc:
        raise _corrupt(key, f"its base64 body does not decode ({exc})") from exc
    if _digest(state) != digest:
        raise _corrupt(key, "its digest does not match its content (truncated or altered)")
    return state


def _corrupt(key: str, why: str) -> RendezvousStateError:
    return RendezvousStateError(
        f"The rendezvous state in the etcd key {key!r} is corrupt: {why}. Stop the job's "
        f"agents, delete that key (etcdctl del '{key}') and start them again; training "
        f"resumes from the last checkpoint."
    )
