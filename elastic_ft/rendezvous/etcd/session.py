"""One gRPC channel to one etcd member: TLS, authentication, and typed calls.

A :class:`Session` is what the failover layer connects and drops; it knows
nothing of retries. Built with user and password, it authenticates at once
and sends etcd's token with every call (as gRPC metadata, which etcd accepts
over plain and TLS channels alike; the options allow a plain one only with
``insecure_auth``). Calls go through grpcio's public channel API with the
message classes of :mod:`.wire`.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from . import wire
from .settings import ConnectionSettings, Endpoint

# gRPC backs off reconnecting to a dead server for up to two minutes by
# default; after an etcd restart that would keep the channel failing long after
# etcd is back. Short backoffs make a restarted member usable within a second.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _channel(endpoint: Endpoint, settings: ConnectionSettings) -> Any:
    import grpc

    if settings.ca_cert is None:
        return grpc.insecure_channel(str(endpoint), options=_GRPC_OPTIONS)
    # A client certificate needs its key and the other way round (options
    # checks it); with only one of them, TLS runs without a client identity.
    with_identity = settings.client_cert is not None and settings.client_key is not None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(settings.ca_cert),
        private_key=_read(settings.client_key) if with_identity else None,
        certificate_chain=_read(settings.client_cert) if with_identity else None,
    )
    return grpc.secure_channel(str(endpoint), credentials, options=_GRPC_OPTIONS)


class Session:
    """A connection to ``endpoint``, authenticated when ``settings.user`` is set.

    Raises (from the constructor and every call) ``grpc.RpcError`` as gRPC
    does: the failover layer classifies it. Thread-safe, as gRPC channels are.
    """

    def __init__(self, endpoint: Endpoint, settings: ConnectionSettings) -> None:
        self.endpoint = endpoint
        self._timeout = settings.request_timeout
        self._channel = _channel(endpoint, settings)
        self._metadata: tuple[tuple[str, str], ...] | None = None
        # Multi-callables by path: made once, as generated stubs do.
        self._stubs: dict[str, Any] = {}
        try:
            if settings.user is not None:
                request = wire.message("AuthenticateRequest", name=settings.user, password=settings.password or "")
                self._metadata = (("token", self.call(wire.AUTHENTICATE, request).token),)
        except BaseException:
            self._channel.close()
            raise

    def _stub(self, method: wire.Method, streaming: bool) -> Any:
        stub = self._stubs.get(method.path)
        if stub is None:
            classes = wire.messages()
            make = self._channel.stream_stream if streaming else self._channel.unary_unary
            stub = self._stubs[method.path] = make(
                method.path,
                request_serializer=classes[method.request].SerializeToString,
                response_deserializer=classes[method.response].FromString,
            )
        return stub

    def call(self, method: wire.Method, request: Any) -> Any:
        """One unary call, bounded by the request timeout."""
        return self._stub(method, False)(request, timeout=self._timeout, metadata=self._metadata)

    def stream(self, method: wire.Method, requests: Iterable[Any], timeout: float) -> Any:
        """A bidirectional stream: an iterator of responses with ``cancel()``."""
        return self._stub(method, True)(iter(requests), timeout=timeout, metadata=self._metadata)

    def responses(self, method: wire.Method, request: Any) -> Iterator[Any]:
        """Send one request on a stream and read until the server ends it."""
        return iter(self.stream(method, [request], self._timeout))

    def close(self) -> None:
        self._channel.close()
