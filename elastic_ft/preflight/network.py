"""This node's network as peers see it: the hostname's address, the socket interfaces, the ports.

gloo (and NCCL's bootstrap) bind to the first address the hostname resolves
to unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface,
and tell peers to connect there. Debian maps the hostname to 127.0.1.1 in
/etc/hosts, so on a stock image every peer is told to connect to its own
loopback: the job hangs at the first collective. That is the most common
multi-node failure, and one the single-node tests never see.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Mapping, Sequence

from elastic_ft.preflight.report import Result

SYS_NET = "/sys/class/net"
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
DEFAULT_MASTER_PORT = 29500
_IFF_UP = 0x1


def resolve(hostname: str) -> list[str]:
    """The addresses ``hostname`` resolves to here, in the resolver's order, without repeats ([] if none)."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def hostname_result(hostname: str, addresses: Sequence[str], multi_node: bool) -> Result:
    """Decide from the addresses ``hostname`` resolved to whether peers can reach this node by it."""
    name = "hostname"
    if not multi_node:
        return Result("SKIP", name, f"{hostname} -> {', '.join(addresses) or 'nothing'}; not checked: the job runs on one machine")
    if not addresses:
        return Result("FAIL", name, f"{hostname!r} does not resolve on this node",
                      f"add '<this node's private IP> {hostname}' to /etc/hosts or to DNS")
    first = addresses[0]
    if ipaddress.ip_address(first.split("%")[0]).is_loopback:
        debian = " (Debian's default /etc/hosts line)" if first == "127.0.1.1" else ""
        return Result(
            "FAIL", name,
            f"{hostname!r} resolves to loopback {first}{debian}: gloo/NCCL would bind there and tell peers to connect "
            f"to their own loopback",
            f"map {hostname} to this node's private IP in /etc/hosts (replace the {first} line), or set "
            f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to the interface peers reach (e.g. eth0)")
    return Result("PASS", name, f"{hostname!r} resolves to {', '.join(addresses)}")


def check_hostname(hostname: str | None, multi_node: bool) -> Result:
    hostname = hostname or socket.gethostname()
    return hostname_result(hostname, resolve(hostname), multi_node)


def interfaces(sys_net: str = SYS_NET) -> dict[str, bool]:
    """This node's interfaces and whether each is up.

    ``lo`` reports operstate ``unknown`` (it has no carrier), so ``unknown``
    counts as up when the IFF_UP flag is set. Without sysfs, every interface
    ``socket.if_nameindex`` lists counts as up.
    """
    try:
        names = sorted(os.listdir(sys_net))
    except OSError:
        return {name: True for _, name in socket.if_nameindex()}
    out = {}
    for name in names:
        state = _read(os.path.join(sys_net, name, "operstate")) or "unknown"
        try:
            flags = int(_read(os.path.join(sys_net, name, "flags")) or "0", 16)
        except ValueError:
            flags = 0
        out[name] = state == "up" or (state == "unknown" and bool(flags & _IFF_UP))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _matches(item: str, name: str, prefix: bool) -> bool:
    # NCCL: a bare name is a prefix ("eth" matches eth0, eth1), "=eth0" is exact. gloo: names are exact.
    if item.startswith("="):
        return name == item[1:]
    return name.startswith(item) if prefix else name == item


def interface_result(var: str, value: str, found: Mapping[str, bool]) -> Result:
    """Decide whether the interfaces ``var=value`` names exist here and are up.

    ``found`` maps each interface of this node to whether it is up. NCCL's
    forms are honoured as its documentation states: prefixes, ``=`` for an
    exact name, ``^`` to exclude (then some interface must remain).
    """
    nccl = var.startswith("NCCL")
    listing = ", ".join(f"{n}({'up' if up else 'down'})" for n, up in found.items()) or "none"
    exclude = nccl and value.startswith("^")
    items = [i.strip() for i in value.lstrip("^").split(",") if i.strip()]
    fix = f"set {var} to one of this node's interfaces: {listing}"
    if not items:
        return Result("FAIL", var, f"{var}={value!r} names no interface", fix)
    if exclude:
        left = [n for n, up in found.items() if up and n != "lo" and not any(_matches(i, n, True) for i in items)]
        if not left:
            return Result("FAIL", var, f"{var}={value!r} excludes every interface that is up", fix)
        return Result("PASS", var, f"{var}={value!r} leaves {', '.join(left)}")
    missing = [i for i in items if not any(_matches(i, n, nccl) for n in found)]
    if missing:
        return Result("FAIL", var, f"{var}={value!r}: no interface {', '.join(missing)} on this node", fix)
    matched = [n for n in found if any(_matches(i, n, nccl) for i in items)]
    up = [n for n in matched if found[n]]
    if not up:
        return Result("FAIL", var, f"{var}={value!r}: {', '.join(matched)} is down", fix)
    return Result("PASS", var, f"{var}={value!r}: {', '.join(up)} up")


def check_interfaces(environ: Mapping[str, str], multi_node: bool) -> list[Result]:
    """One result per interface variable set; a SKIP when neither is."""
    found = interfaces()
    out = [interface_result(var, environ[var], found) for var in IFACE_VARS if environ.get(var)]
    if out:
        return out
    why = "gloo/NCCL use the interface the hostname resolves to (see the hostname check)"
    return [Result("SKIP", "interface", f"neither {' nor '.join(IFACE_VARS)} is set; {why}"
                   + ("" if multi_node else "; the job runs on one machine"))]


def reachable(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None if a TCP connection to ``host:port`` opens within ``timeout_s``; else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def port_free(port: int) -> bool:
    """Whether this node could listen on ``port`` (all addresses), as rank 0's TCPStore does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def rdzv_port_result(endpoint: str, problem: str | None) -> Result:
    if problem is None:
        return Result("PASS", "rdzv_port", f"{endpoint} accepts TCP connections")
    return Result("FAIL", "rdzv_port", f"cannot connect to {endpoint}: {problem}",
                  "start etcd there, or open the port in the security group / firewall between the nodes")


def master_port_result(port: int, free: bool, master: str | None, problem: str | None) -> Result:
    """``free``: nothing listens on ``port`` here; ``master``/``problem``: MASTER_ADDR and why it did not answer."""
    if free:
        return Result("PASS", "master_port", f"{port} is free on this node")
    if master and problem is None:
        return Result("PASS", "master_port", f"{port} is in use here and {master}:{port} answers")
    return Result("WARN", "master_port", f"{port} is in use on this node"
                  + (f" and {master}:{port} does not answer ({problem})" if master else ""),
                  "stop the process holding it (an old job's store?) or set MASTER_PORT to a free port")


def check_master_port(environ: Mapping[str, str]) -> Result:
    text = environ.get("MASTER_PORT") or str(DEFAULT_MASTER_PORT)
    if not text.isdigit() or not 0 < int(text) < 65536:
        return Result("FAIL", "master_port", f"MASTER_PORT={text!r} is not a port", "set it to 1..65535, or unset it")
    port = int(text)
    free = port_free(port)
    master = environ.get("MASTER_ADDR")
    problem = None if free or not master else reachable(master, port)
    return master_port_result(port, free, master, problem)
