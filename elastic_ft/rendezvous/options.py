"""Options of the etcd3 rendezvous backend, parsed from torchrun's ``--rdzv-conf``.

``torchrun --rdzv-backend=etcd3 --rdzv-endpoint=HOST:PORT --rdzv-conf k=v,...``
hands us a :class:`RendezvousParameters` whose ``config`` holds the
``--rdzv-conf`` pairs as strings. :func:`parse_options` turns them into one
frozen dataclass, checking every option and collecting all problems into a
single ``ValueError`` that names each bad option and value.

Several etcd members can be given either in the endpoint
(``--rdzv-endpoint=h1:2379,h2:2379``) or in the ``endpoints`` option, separated
by ``;`` or ``|`` (``--rdzv-conf`` itself is split on commas). The client fails
over between them in order.

Credentials (``user`` with ``password_env``, the name of an environment
variable that holds the password) need TLS (``ca_cert``): etcd's password
authentication sends the password, and then a token that stands for the user,
with every request. Without TLS they are refused unless ``insecure_auth=true``
says the network is trusted. ``password=`` itself is refused: ``--rdzv-conf``
is on torchrun's command line, which every user of the node can read (``ps``).

The secret that authenticates the rendezvous state (``ELASTIC_FT_RDZV_KEY``,
else the etcd password; see :mod:`~elastic_ft.rendezvous.state_codec`) is
resolved here too. The variables that held secrets are listed in
:attr:`EtcdRendezvousOptions.secret_env`, so that the agent can take them out
of the environment its workers inherit.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

from .etcd import ConnectionSettings, Endpoint
from .state_codec import KEY_ENV, StateSecret, state_secret

# The largest number any option takes (seconds or a count): 115 days.
_MAX_NUMBER = 10_000_000

DEFAULT_PORT = 2379

# The defaults for fast recovery (see EtcdRendezvousOptions).
DEFAULT_KEEP_ALIVE_INTERVAL = 2
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 3
DEFAULT_LAST_CALL_S = 3

# Options that torch's dynamic rendezvous reads itself (see
# torch.distributed.elastic.rendezvous.dynamic_rendezvous.create_handler); we
# validate them too so that every mistake is reported at once.
_TORCH_TIMEOUTS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")

# torchrun always adds "timeout" (its --rdzv-timeout, default 900); the
# dynamic rendezvous ignores it in favour of join_timeout, and so do we.
_IGNORED = ("timeout",)


@dataclass(frozen=True, kw_only=True)
class EtcdRendezvousOptions:
    """Everything the etcd3 backend needs besides the run id and node counts."""

    connection: ConnectionSettings
    """Endpoints, TLS, credentials, request timeouts and lease TTL: what the etcd client needs."""

    key_prefix: str = "/elastic_ft/rendezvous"
    """Every key of a run lives under ``<key_prefix>/<run_id>/``."""

    # Defaults chosen for fast recovery on spot fleets (torch's in brackets).
    # Survivors restart when a member's keep-alive is older than
    # keep_alive_interval * keep_alive_max_attempt (6 s [15 s]); then the new
    # round completes last_call_timeout after enough nodes rejoined (3 s [30 s]:
    # the survivors of one job rejoin within about a second of each other, and
    # a node later than that joins the running job as any new node does). After a leave on a spot
    # notice the survivors know who comes, and the round closes once they are all in
    # (elastic_ft.rendezvous.spot_leave).
    # A heartbeat every 2 s is one lease keep-alive per node (no write of the
    # state: elastic_ft.rendezvous.leased_heartbeats), cheap for etcd; three
    # missed in a row still ride out a loaded host.
    # join_timeout keeps torch's 600 s: how long a lone node waits for
    # min_nodes, where spot capacity may take minutes to come back.
    join_timeout: timedelta | None = None
    """None: torch's default (600 s)."""
    last_call_timeout: timedelta | None = timedelta(seconds=DEFAULT_LAST_CALL_S)
    close_timeout: timedelta | None = None
    heartbeat_timeout: timedelta | None = None
    keep_alive_interval: int = DEFAULT_KEEP_ALIVE_INTERVAL
    keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT

    state_secret: StateSecret | None = None
    """What authenticates the rendezvous state; None: nothing (its types are checked instead)."""
    secret_env: tuple[str, ...] = ()
    """The environment variables that held a secret read here (``password_env``'s, ``ELASTIC_FT_RDZV_KEY``)."""

    def run_prefix(self, run_id: str) -> str:
        """The key prefix of one run: its state key and its store live under it."""
        return f"{self.key_prefix}/{run_id}/"


KNOWN_OPTIONS = (
    "endpoints",
    "key_prefix",
    "lease_ttl",
    "request_timeout",
    "retry_timeout",
    "ca_cert",
    "client_cert",
    "client_key",
    "user",
    "password",
    "password_env",
    "insecure_auth",
    *_TORCH_TIMEOUTS,
    "keep_alive_interval",
    "keep_alive_max_attempt",
)

# Names torch's etcd-v2 backend uses for the same files, accepted so that an
# existing --rdzv-conf keeps working.
_ALIASES = {"ssl_cert": "client_cert", "ssl_cert_key": "client_key"}


def parse_endpoints(text: str, problems: list[str], option: str) -> list[Endpoint]:
    """Parse ``host[:port]`` items separated by ``,``, ``;``, ``|`` or spaces."""
    out: list[Endpoint] = []
    for item in re.split(r"[,;|\s]+", text.strip()):
        if not item:
            continue
        item = re.sub(r"^[a-z]+://", "", item)  # accept http://host:port as etcdctl does
        host, sep, port_text = item.rpartition(":")
        if not sep:
            host, port_text = item, str(DEFAULT_PORT)
        host = host.strip("[]")
        if not host or not re.fullmatch(r"[\w.:-]+", host):
            problems.append(f"{option}: the host of endpoint {item!r} is not a valid host name.")
            continue
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            problems.append(
                f"{option}: the port of endpoint {item!r} must be an integer between 1 and 65535."
            )
            continue
        out.append(Endpoint(host, int(port_text)))
    return out


def flag(key: str, problems: list[str], conf: Mapping[str, Any]) -> bool:
    """A boolean option: true/false, yes/no, 1/0 (any case); absent is false."""
    raw = conf.get(key)
    if raw is None or raw == "":
        return False
    text = str(raw).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    problems.append(f"{key}: {raw!r} is not a boolean; use true or false.")
    return False


@dataclass
class _Conf:
    """The ``--rdzv-conf`` pairs (aliases resolved) and every problem found in them so far.

    Each reader returns a usable default when the option is bad and appends
    one line naming the option to ``problems``, so that :func:`parse_options`
    reports all mistakes at once.
    """

    conf: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    def number(
        self, key: str, kind: type, default: Any, minimum: float = 0, strict: bool = True
    ) -> Any:
        """An int or float option above ``minimum`` (or at least it, if not ``strict``).

        Absent or empty: ``default``. Bad (not a number, out of range, nan, inf
        or over ``_MAX_NUMBER``): a problem, and ``default``.
        """
        raw = self.conf.get(key)
        if raw is None or raw == "":
            return default
        try:
            value = kind(raw)
        except (TypeError, ValueError, OverflowError):
            self.problems.append(f"{key}: {str(raw)[:40]!r} is not a valid {kind.__name__}.")
            return default
        if (strict and value <= minimum) or (not strict and value < minimum):
            bound = "greater than" if strict else "at least"
            self.problems.append(f"{key}: {raw!r} must be {bound} {minimum:g}.")
            return default
        # Every option is seconds or a count: nan, inf or a huge value would make
        # an unbounded wait (or overflow timedelta with a traceback).
        if not math.isfinite(value) or value > _MAX_NUMBER:
            self.problems.append(
                f"{key}: {str(raw)[:40]!r} must be a finite number at most {_MAX_NUMBER:g}."
            )
            return default
        return value

    def timeout(self, key: str, default_s: int | None = None) -> timedelta | None:
        """Whole seconds as a timedelta; absent (or bad): ``default_s``, or None (torch's default)."""
        value = self.number(key, int, default_s)
        return None if value is None else timedelta(seconds=value)

    def path(self, key: str) -> str | None:
        """A file that must exist on this node; absent: None."""
        raw = self.conf.get(key)
        if raw is None:
            return None
        if not os.path.isfile(raw):
            self.problems.append(f"{key}: the file {raw!r} does not exist.")
        return str(raw)

    def flag(self, key: str) -> bool:
        """See :func:`flag`."""
        return flag(key, self.problems, self.conf)


def _check_known(c: _Conf) -> None:
    """One problem per option that neither we nor torch's dynamic rendezvous read."""
    for key in sorted(k for k in c.conf if k not in KNOWN_OPTIONS and k not in _IGNORED):
        c.problems.append(
            f"{key}: unknown option of the etcd3 rendezvous backend; known options are "
            f"{', '.join(KNOWN_OPTIONS)}."
        )


def _endpoints(endpoint: str | None, c: _Conf) -> tuple[Endpoint, ...]:
    """The endpoint's members, then the ``endpoints`` option's, without repeats, in order."""
    endpoints = parse_endpoints(endpoint or "", c.problems, "rdzv_endpoint")
    if c.conf.get("endpoints"):
        endpoints += parse_endpoints(str(c.conf["endpoints"]), c.problems, "endpoints")
    endpoints = list(dict.fromkeys(endpoints))
    # "None given" only when nothing was given: a bad item already has its own line.
    if not endpoints and not any(p.startswith(("rdzv_endpoint", "endpoints")) for p in c.problems):
        c.problems.append(
            "rdzv_endpoint: no etcd endpoint given; pass --rdzv-endpoint=HOST:PORT "
            "(or the endpoints option)."
        )
    return tuple(endpoints)


def _key_prefix(c: _Conf) -> str:
    """The ``key_prefix`` option without its trailing ``/``: absolute, with no empty part."""
    key_prefix = str(c.conf.get("key_prefix", "/elastic_ft/rendezvous")).rstrip("/")
    if not key_prefix.startswith("/") or "//" in key_prefix:
        c.problems.append(
            f"key_prefix: {c.conf.get('key_prefix')!r} must be an absolute key path like "
            f"/elastic_ft/rendezvous."
        )
    return key_prefix


def _tls(c: _Conf) -> tuple[str | None, str | None, str | None]:
    """``(ca_cert, client_cert, client_key)``: the client pair goes together and needs the CA."""
    ca_cert = c.path("ca_cert")
    client_cert = c.path("client_cert")
    client_key = c.path("client_key")
    if (client_cert is None) != (client_key is None):
        c.problems.append(
            "client_cert/client_key: give both the client certificate and its key, or neither."
        )
    if client_cert is not None and ca_cert is None:
        c.problems.append(
            "ca_cert: a client certificate needs ca_cert too (TLS is off without it)."
        )
    return ca_cert, client_cert, client_key


def _credentials(
    c: _Conf, environ: Mapping[str, str], tls: bool
) -> tuple[Any, Any]:
    """``(user, password)``, the password from the variable ``password_env`` names.

    ``password=`` is a problem (it is on the command line), and so are
    credentials without TLS unless ``insecure_auth`` is true.
    """
    user = c.conf.get("user")
    password = None
    password_env = c.conf.get("password_env")
    if "password" in c.conf:
        # Never echo its value: the problem line is printed and logged.
        c.problems.append(
            "password: --rdzv-conf is on torchrun's command line, where every user of the node "
            "sees it (ps); give password_env=VAR instead, the name of an environment variable "
            "that holds the etcd password."
        )
    elif password_env:
        password = environ.get(str(password_env))
        if password is None:
            c.problems.append(
                f"password_env: the environment variable {password_env!r} is not set."
            )
    given = password is not None or "password" in c.conf  # a refused password= has its own line
    if (user is None) == given:
        c.problems.append("user/password: give both the etcd user and its password, or neither.")
    insecure_auth = c.flag("insecure_auth")
    if (user is not None or given) and not tls and not insecure_auth:
        # Without TLS, etcd's Authenticate call carries the password in clear
        # text, and the token it returns lets anyone on the path act as the user.
        c.problems.append(
            "user/password: etcd credentials without TLS would cross the network in clear text; "
            "give ca_cert (the CA of etcd's server certificate) to turn TLS on, or set "
            "insecure_auth=true to accept that on a trusted network."
        )
    return user, password


def _torch_settings(c: _Conf) -> dict[str, Any]:
    """The options torch's dynamic rendezvous reads: its timeouts and keep-alive."""
    return dict(
        join_timeout=c.timeout("join_timeout"),
        last_call_timeout=c.timeout("last_call_timeout", DEFAULT_LAST_CALL_S),
        close_timeout=c.timeout("close_timeout"),
        heartbeat_timeout=c.timeout("heartbeat_timeout"),
        keep_alive_interval=c.number("keep_alive_interval", int, DEFAULT_KEEP_ALIVE_INTERVAL),
        keep_alive_max_attempt=c.number("keep_alive_max_attempt", int, DEFAULT_KEEP_ALIVE_MAX_ATTEMPT),
    )


def parse_options(
    endpoint: str | None, config: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> EtcdRendezvousOptions:
    """Build :class:`EtcdRendezvousOptions` from torchrun's endpoint and ``--rdzv-conf``.

    ``environ`` (default: ``os.environ``) is where ``password_env`` is looked up.

    Raises:
        ValueError: listing every bad or unknown option with its value.
    """
    environ = os.environ if environ is None else environ
    c = _Conf({_ALIASES.get(key, key): value for key, value in config.items()})
    # The readers run in this order so that problems are listed as before:
    # unknown options, endpoints, key prefix, TLS, credentials, numbers.
    _check_known(c)
    endpoints = _endpoints(endpoint, c)
    key_prefix = _key_prefix(c)
    ca_cert, client_cert, client_key = _tls(c)
    user, password = _credentials(c, environ, tls=ca_cert is not None)
    default = ConnectionSettings(endpoints=())
    connection = ConnectionSettings(
        endpoints=endpoints,
        lease_ttl=c.number("lease_ttl", int, default.lease_ttl),
        request_timeout=c.number("request_timeout", float, default.request_timeout),
        retry_timeout=c.number("retry_timeout", float, default.retry_timeout),
        ca_cert=ca_cert,
        client_cert=client_cert,
        client_key=client_key,
        user=user,
        password=password,
    )
    torch_settings = _torch_settings(c)
    try:
        secret = state_secret(environ, password)
    except ValueError as exc:
        c.problems.append(str(exc))
        secret = None
    secret_env = tuple(
        name for name, read in ((str(c.conf.get("password_env")), password is not None),
                                (KEY_ENV, KEY_ENV in environ)) if read
    )
    if c.problems:
        raise ValueError(
            "The etcd3 rendezvous options are invalid:\n  - " + "\n  - ".join(c.problems)
        )
    return EtcdRendezvousOptions(
        connection=connection, key_prefix=key_prefix, state_secret=secret, secret_env=secret_env,
        **torch_settings,
    )
