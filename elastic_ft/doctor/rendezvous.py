"""The rendezvous as the doctor sees it: etcd answers and speaks v3 (the versions: :mod:`elastic_ft.preflight.versions`).

The connection is :func:`elastic_ft.rendezvous.probe.open_client`'s, with short
timeouts and the versions' lease.
"""

from __future__ import annotations

from typing import Any, Mapping

from elastic_ft.preflight.report import Result
from elastic_ft.preflight.versions import VERSIONS_TTL_S
from elastic_ft.rendezvous import probe
from elastic_ft.rendezvous.probe import parse_conf

_FIX_DOWN = ("start etcd (etcd --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://HOST:2379), "
             "or correct --rdzv_endpoint; check the firewall between this node and etcd")


def open_client(endpoint: str, conf: Mapping[str, str], environ: Mapping[str, str] | None = None) -> tuple[Any, Any]:
    """``(options, client)`` for the run's etcd with short timeouts, posting on the versions' lease."""
    return probe.open_client(endpoint, conf, environ, lease_ttl=VERSIONS_TTL_S, name="doctor")


def etcd_result(endpoint: str, version: str | None, problem: str | None) -> Result:
    """Decide from etcd's Status answer (its version) or the error that stood in for it."""
    if problem is not None:
        return Result("FAIL", "rendezvous", f"etcd at {endpoint} did not answer: {problem}", _FIX_DOWN)
    if not version or not version.startswith("3."):
        return Result("FAIL", "rendezvous", f"{endpoint} answered as etcd version {version!r}, not 3.x",
                      "the etcd3 rendezvous needs etcd 3.4 or later")
    return Result("PASS", "rendezvous", f"etcd {version} at {endpoint} answers the v3 API")


def check_etcd(client: Any) -> Result:
    from elastic_ft.rendezvous.etcd import EtcdClientError, EtcdUnavailableError

    endpoint = client.settings.endpoints_text
    try:
        return etcd_result(endpoint, client.server_version(), None)
    except EtcdUnavailableError as exc:
        return etcd_result(endpoint, None, str(exc).splitlines()[0])
    except EtcdClientError as exc:  # bad credentials or TLS: etcd is there but refuses us
        return Result("FAIL", "rendezvous", f"etcd at {endpoint} refused this client: {exc}",
                      "check user/password_env and the TLS files in --rdzv_conf")


__all__ = ["check_etcd", "etcd_result", "open_client", "parse_conf"]
