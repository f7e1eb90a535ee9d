"""A short-timeout client of a run's etcd, for the doctor and ``elastic-ft status``: one answer or a finding.

The connection is the agent's own (the ``--rdzv_conf`` options parsed as
torchrun's are, TLS and credentials included) with short timeouts: a tool
that retries for the rendezvous's 30 s looks hung exactly when etcd is down.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def parse_conf(text: str | None) -> dict[str, str]:
    """``k=v,k=v`` as torchrun's ``--rdzv-conf`` takes it; ValueError naming an item without ``=``."""
    out = {}
    for item in filter(None, (i.strip() for i in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv_conf item {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def open_client(endpoint: str, conf: Mapping[str, str], environ: Mapping[str, str] | None = None, *,
                lease_ttl: int = 300, name: str = "doctor") -> tuple[Any, Any]:
    """``(options, client)`` for the run's etcd with short timeouts; ValueError listing bad options.

    ``lease_ttl``: the lifetime of what the client posts on its lease (not the rendezvous's).
    """
    from elastic_ft.rendezvous.etcd import EtcdClient
    from elastic_ft.rendezvous.options import parse_options

    options = parse_options(endpoint, conf, environ)
    # Short: one slow answer is a finding, not something to wait out.
    settings = dataclasses.replace(options.connection, request_timeout=3.0, retry_timeout=2.0, lease_ttl=lease_ttl)
    return options, EtcdClient(settings, name=name)
