"""Free TCP ports on 127.0.0.1, for servers that must be told their port before they bind it.

A pick is check-then-use: another process may bind the port before the server does. Servers that
can bind port 0 and report the port do that instead (moto, the fault proxy, the fake IMDS, the S3
stub); etcd and SeaweedFS cannot, and retry a first start on new ports when a pick was taken
(tests/rendezvous/etcd_server.py, tests/checkpoint/s3_servers.py). ``free_port()`` also names a port
where nothing listens, for tests of an unreachable endpoint.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int, offset: int = 0) -> list[int]:
    """``count`` distinct free ports ``p`` (with ``offset``: ``p + offset`` free too, and distinct).

    All are held bound together while they are chosen: one ``free_port()``
    after another may hand out the port it just released, and a server given
    the same port twice fails at start.
    """
    ports: list[int] = []
    with ExitStack() as held:
        for _ in range(100 * count):
            if len(ports) == count:
                return ports
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if offset:
                if port + offset > 65535:
                    continue
                try:
                    held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(
                        ("127.0.0.1", port + offset))
                except OSError:
                    continue
            ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports (p, p+{offset}) found on 127.0.0.1")
