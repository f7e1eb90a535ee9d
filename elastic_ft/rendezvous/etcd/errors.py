"""What can go wrong talking to etcd, and which faults are worth retrying.

Public errors (raised by :class:`~elastic_ft.rendezvous.etcd.client.EtcdClient`)
are :class:`EtcdClientError` and its subclasses. The functions here classify the
exceptions gRPC raises: :func:`is_transient` decides what the failover layer
retries on the next member; :func:`describe` and :func:`hint` turn the rest into
one sentence a user can act on.
"""

from __future__ import annotations

from typing import Any


class EtcdClientError(RuntimeError):
    """etcd rejected a request, or the client cannot be used as configured."""


class EtcdUnavailableError(EtcdClientError):
    """No etcd endpoint answered within the retry window."""


class EtcdLeaseError(EtcdClientError):
    """The lease was not found on the server (expired or revoked)."""


class LeaseGone(EtcdClientError):
    """Internal: our lease expired on the server; a new one is granted."""


class AuthTokenExpired(Exception):
    """Internal: the simple auth token expired (or etcd restarted); re-authenticate."""


def grpc_code(exc: BaseException | None) -> Any:
    """The ``grpc.StatusCode`` of ``exc``, or ``None`` if it is not a (complete) gRPC error."""
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return code()
        except Exception:  # a half-built RpcError has no code
            return None
    return None


def grpc_details(exc: BaseException) -> str:
    """The server's message of a gRPC error, or ``str(exc)`` for other exceptions."""
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return details() or ""
        except Exception:
            return ""
    return str(exc)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying on the same or another member."""
    if isinstance(exc, AuthTokenExpired):
        return True
    if isinstance(exc, ValueError) and "closed channel" in str(exc):
        # Another thread closed the channel after a fault (failover).
        return True
    import grpc

    # UNAVAILABLE covers connection refused/reset, "leader changed" and "no
    # leader"; DEADLINE_EXCEEDED a member that is partitioned or overloaded;
    # CANCELLED a call whose channel another thread closed to fail over.
    return grpc_code(exc) in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    )


def is_auth_token_error(exc: BaseException) -> bool:
    """etcd's simple tokens expire (5 min by default) and die with a restart."""
    return "invalid auth token" in grpc_details(exc)


def is_lease_not_found(exc: BaseException | None) -> bool:
    return exc is not None and "lease not found" in grpc_details(exc)


def describe(exc: BaseException | None) -> str:
    """One line naming the gRPC status and the server's message (or the exception's text)."""
    if exc is None:
        return "no error"
    code = grpc_code(exc)
    if code is not None:
        return f"{code.name}: {grpc_details(exc)}"
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if cause is not None and grpc_code(cause) is not None:
        return f"{text} ({describe(cause)})"
    return text


def hint(exc: BaseException) -> str:
    """What the user can do about a fault that retrying does not fix."""
    details = describe(exc).lower()
    if "authentication failed" in details or "user name is empty" in details:
        return "Check the user and password rendezvous options (etcd has auth enabled)."
    if "permission denied" in details:
        return (
            "etcd has authentication on and this client's user (the user and password options, "
            "or else the common name of its TLS client certificate) may not read and write the "
            "rendezvous key prefix: give the user and password options, or grant that user a "
            "role on the prefix."
        )
    return "See the inner exception for details."
