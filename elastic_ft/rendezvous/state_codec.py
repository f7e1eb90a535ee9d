"""How the rendezvous state is written in etcd: authenticated, so that etcd cannot run code in the agents.

torch's dynamic rendezvous hands the backend its state as opaque bytes (a
pickle) and unpickles whatever the backend returns. Whoever can write the run's
etcd key could therefore run code in every agent of the job. So the value in
etcd is

    ``eft-state/2:`` KEY-ID ``:`` TAG ``:`` base64(state)

where TAG is the 64 hex digits of an HMAC-SHA256, with the job's key, over
everything before it plus the base64 body, and KEY-ID (16 hex digits, an HMAC
of a fixed label) names the key without revealing it, so that a state written
with another key can be told apart from a damaged one. Decoding checks the
marker, then the key id, then the tag (``hmac.compare_digest``), and only then
decodes the base64: nothing is unpickled (here or by torch) unless it
verifies. Anything else, including the raw pickles and ``eft-state/1`` values
of older versions, is refused with one line naming the etcd key.

Where the key comes from (:func:`state_secret`), the same on every agent of a job:

1. ``ELASTIC_FT_RDZV_KEY`` (:data:`KEY_ENV`) in the agent's environment: a
   secret of at least 16 characters the user gives every node (e.g.
   ``openssl rand -hex 32``; on AWS Batch as a ``secrets`` item, so the value
   is not in the job definition).
2. Otherwise the etcd password (``password_env`` or a file option): every
   agent of a job logs in as the same user, and etcd keeps only a bcrypt hash
   of it, so etcd and its root do not have the key.

Either secret is stretched with PBKDF2-HMAC-SHA256 (:data:`KDF_ITERATIONS`
rounds, salted with the state's etcd key), so a tag read from etcd is no
cheap test of a password guess, and a state cannot be replayed into another
run's key. The torchx component deliberately does not generate a
per-submission key: a run id spans submissions (the same command again
resumes a failed run, several submissions make heterogeneous nodes, a node
that left is resubmitted), and they must all read the same state.

3. Neither (a plain etcd without auth, as in torch's own backend contract
   tests and a local trial): the state is written with the same envelope
   under the empty key, which detects damage but authenticates nothing, since
   anyone who can reach such an etcd can write it. What keeps that safe is the
   second check, made before the state is handed to torch: the pickle is
   loaded with an unpickler that resolves only the state's own types
   (:data:`STATE_GLOBALS`: torch's ``_RendezvousState`` and ``_NodeDesc``,
   ``datetime``'s ``datetime``, ``timezone`` and ``timedelta``), so a pickle
   naming any other callable (``os.system``, ``builtins.eval``...) is refused
   before torch loads it. A writer of that etcd can still change the
   membership (as it can delete keys); it cannot run code. The handler logs
   one WARNING line per agent saying so.

Cost: one PBKDF2 per agent start (about 0.1 s); per state read or write one
HMAC over the state, which grows linearly with the number of nodes (about
80 bytes each; well under a millisecond at 64 nodes), and without a key one
more load of the pickle, as costly as torch's own (about 1 ms at 64 nodes,
9 ms at 512, measured on this 2-core host).

A state written by one version of this module is not read by another version:
stop the job's agents and delete the key (the messages say how); training
resumes from the last checkpoint.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import io
import logging
import pickle
import re
from dataclasses import dataclass, field
from typing import Mapping

from torch.distributed.elastic.rendezvous import RendezvousStateError

MARKER = b"eft-state/2:"
KEY_ENV = "ELASTIC_FT_RDZV_KEY"
"""The environment variable that holds the job's rendezvous state secret."""

MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 4096

KDF_ITERATIONS = 200_000
"""PBKDF2 rounds: a password guess checked against a stored tag costs this many HMACs."""

_NO_KEY = b"none"  # the key id of a state written without a key
_KEY_ID_CHARS = 16
_TAG_CHARS = 64  # hex digits of an HMAC-SHA256

STATE_GLOBALS = frozenset({
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
})
"""The only globals torch 2.13's pickled ``_RendezvousState`` names; a state
without a key may name no others (exact names: no dotted paths)."""


@dataclass(frozen=True)
class StateSecret:
    """The secret the rendezvous state is authenticated with, and where it came from."""

    value: str = field(repr=False)
    source: str
    """For messages: ``"ELASTIC_FT_RDZV_KEY"`` or ``"the etcd password"``."""


def state_secret(environ: Mapping[str, str], password: str | None) -> StateSecret | None:
    """The job's secret: :data:`KEY_ENV` from ``environ``, else the etcd ``password``, else None.

    Raises:
        ValueError: :data:`KEY_ENV` is set but shorter than :data:`MIN_SECRET_CHARS`
            or longer than :data:`MAX_SECRET_CHARS` characters (the message names it,
            never the value).
    """
    value = environ.get(KEY_ENV)
    if value is not None:
        if not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
            raise ValueError(
                f"{KEY_ENV}: the rendezvous key must have {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} "
                f"characters (it has {len(value)}); generate one with 'openssl rand -hex 32' and give "
                f"the same to every node."
            )
        return StateSecret(value, KEY_ENV)
    if password:
        return StateSecret(password, "the etcd password")
    return None


class StateCodec:
    """Encodes and decodes the rendezvous state stored in one etcd key.

    Args:
        secret: the job's secret, or None (no key: see the module docstring, case 3).
        key: the etcd key the state lives in; it salts the key derivation and
            is named in every error.
    """

    def __init__(self, secret: StateSecret | None, key: str) -> None:
        self.key = key
        self.source = secret.source if secret else None
        if secret is None:
            self._mac_key = b""
            self.key_id = _NO_KEY
        else:
            salt = b"elastic_ft rendezvous state\0" + key.encode()
            self._mac_key = hashlib.pbkdf2_hmac("sha256", secret.value.encode(), salt, KDF_ITERATIONS)
            self.key_id = _mac(self._mac_key, b"key id").hex()[:_KEY_ID_CHARS].encode()

    @property
    def authenticated(self) -> bool:
        """Whether states are authenticated with a secret (False: integrity and type checks only)."""
        return self.source is not None

    def protection(self, run_id: str) -> tuple[int, str, str, str]:
        """``(level, format, run_id, key)`` of the agent's one log line on how the state is protected:
        INFO with a key, WARNING without one."""
        if self.authenticated:
            return (logging.INFO, f"Rendezvous %r: the state in etcd key %s is authenticated with a key "
                    f"from {self.source}.", run_id, self.key)
        return (
            logging.WARNING,
            f"Rendezvous %r: the state in etcd key %s is not authenticated (no {KEY_ENV} and no etcd "
            f"password): whoever can write that key can change the membership; its pickle is checked to "
            f"name only the rendezvous state's types, so it cannot run code here. Set the same {KEY_ENV} "
            f"on every node, or use etcd auth.",
            run_id, self.key,
        )

    def encode(self, state: bytes) -> bytes:
        """The value stored in etcd for ``state``."""
        signed = MARKER + self.key_id + b":"
        body = base64.b64encode(state)
        return signed + _mac(self._mac_key, signed + body).hex().encode() + b":" + body

    def decode(self, value: bytes) -> bytes:
        """The state stored as ``value``, once it verifies; nothing is unpickled before.

        Raises:
            RendezvousStateError: one line naming the etcd key, what is wrong
                and what to do; raised before any byte of ``value`` is unpickled.
        """
        if not value.startswith(MARKER):
            raise self._refused(_unmarked(value))
        key_id, sep1, rest = value[len(MARKER):].partition(b":")
        tag, sep2, body = rest.partition(b":")
        if not (sep1 and sep2) or len(tag) != _TAG_CHARS:
            raise self._refused("its header is damaged (truncated or altered)")
        if key_id != self.key_id:
            raise self._refused(self._other_key(key_id))
        expected = _mac(self._mac_key, value[: len(MARKER) + len(key_id) + 1] + body).hex().encode()
        if not hmac.compare_digest(tag, expected):
            what = "authentication tag" if self.authenticated else "digest"
            raise self._refused(f"its {what} does not verify (truncated, altered or forged)")
        try:
            state = base64.b64decode(body, validate=True)
        except binascii.Error as exc:  # a verified tag over a bad body: written so on purpose
            raise self._refused(f"its body does not decode ({exc})") from exc
        if not self.authenticated:
            check_state_types(state, self.key)
        return state

    def _other_key(self, key_id: bytes) -> str:
        # Written by whoever wrote the value: shown only if it has the shape of a key id (one line).
        shown = key_id.decode() if re.fullmatch(rb"[0-9a-f]{%d}" % _KEY_ID_CHARS, key_id) else "unreadable"
        if key_id == _NO_KEY:
            return (f"it was written without a key, and this agent has one ({self.source}): every agent "
                    f"of the run needs the same {KEY_ENV} or etcd password")
        if not self.authenticated:
            return (f"it was written with a key (id {shown}) and this agent has none: set the same "
                    f"{KEY_ENV} (or etcd user and password) on every agent of the run")
        return (f"it was written with another key (id {shown}; this agent's, from {self.source}, is "
                f"{self.key_id.decode()}): every agent of the run needs the same {KEY_ENV} or etcd password")

    def _refused(self, why: str) -> RendezvousStateError:
        return RendezvousStateError(
            f"The rendezvous state in the etcd key {self.key!r} is refused: {why}. Nothing of it was "
            f"loaded. Stop the job's agents, delete that key (etcdctl del '{self.key}') and start them "
            f"again with the same key on every node; training resumes from the last checkpoint."
        )


def _mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _unmarked(value: bytes) -> str:
    """Why a value without the marker is refused."""
    if value.startswith(b"eft-state/"):
        return "it was written by an older elastic_ft, without authentication"
    if value[:1] == b"\x80":
        return "it is a raw pickle (an older elastic_ft's format, or written by hand)"
    return f"it does not start with {MARKER.decode()!r}"


class _StateUnpickler(pickle.Unpickler):
    """Resolves only :data:`STATE_GLOBALS`: any other global ends the load before it is called."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in STATE_GLOBALS:
            # The names come from the stored value: printable and short, so the message stays one line.
            raise _ForbiddenGlobal("".join(c if c.isprintable() else "?" for c in f"{module}.{name}"[:120]))
        return super().find_class(module, name)


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


def load_state(state: bytes) -> object:
    """The rendezvous state object of ``state`` (a pickle), through an unpickler that resolves only
    :data:`STATE_GLOBALS`: any other global raises :class:`pickle.UnpicklingError` before it is called."""
    return _StateUnpickler(io.BytesIO(state)).load()


def check_state_types(state: bytes, key: str) -> None:
    """Refuse a state whose pickle names anything but the rendezvous state's own types.

    For states without a key only (module docstring, case 3). The load runs
    the same opcodes as torch's ``pickle.loads`` of the same bytes, with the
    same objects for the allowed names, so what it lets through can construct
    nothing else there either. Bytes that are not a pickle at all pass: torch
    then fails to load them with its own error, having called nothing.

    Raises:
        RendezvousStateError: naming the etcd key and the refused global.
    """
    try:
        load_state(state)
    except _ForbiddenGlobal as exc:
        raise RendezvousStateError(
            f"The rendezvous state in the etcd key {key!r} is refused: its pickle names {exc}, which "
            f"is not a type of the rendezvous state (states are not authenticated without "
            f"{KEY_ENV} or an etcd password, so their types are checked). Stop the job's agents, "
            f"delete that key (etcdctl del '{key}'), restrict who may write to etcd, and start them "
            f"again; training resumes from the last checkpoint."
        ) from None
    except Exception:  # noqa: BLE001 - not a (whole) pickle: harmless, and torch reports it when it loads
        return
