"""How to reach etcd: the members' addresses, TLS files, credentials, timeouts, lease TTL.

Plain data: :func:`elastic_ft.rendezvous.options.parse_options` validates the
``--rdzv-conf`` options into :class:`ConnectionSettings`; the
:class:`~elastic_ft.rendezvous.etcd.client.EtcdClient` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client address."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ConnectionSettings:
    """How to reach etcd: the ``--rdzv-conf`` options of the same names
    (parsed and validated by :func:`elastic_ft.rendezvous.options.parse_options`)."""

    endpoints: tuple[Endpoint, ...]
    """etcd client endpoints, tried in order; the first answers unless it is down."""

    request_timeout: float = 10.0
    """Seconds one etcd request may take before it counts as a (retried) failure."""

    retry_timeout: float = 30.0
    """Seconds of consecutive transient failures (etcd down, leader change) before giving up."""

    ca_cert: str | None = None
    """PEM file of the CA that signed etcd's server certificate; turns TLS on."""

    client_cert: str | None = None
    """PEM file of this client's certificate, for etcd's --client-cert-auth."""

    client_key: str | None = None
    """PEM file of this client's private key (goes with client_cert)."""

    user: str | None = None
    """etcd user name, when etcd has authentication enabled."""

    password: str | None = field(default=None, repr=False)
    """etcd password; also read from the environment variable named by password_env."""

    lease_ttl: int = 7200
    """Seconds after the last write by any agent before a run's keys expire (abandoned runs)."""

    @property
    def endpoints_text(self) -> str:
        return ", ".join(str(e) for e in self.endpoints)
