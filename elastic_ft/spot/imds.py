"""An IMDSv2 client for the two spot notices: the instance action and the rebalance recommendation.

Only the standard library (urllib) is used, with no proxy (an ``http_proxy``
in the environment must not swallow requests to the link-local address) and
short timeouts: a poll that hangs would only delay the notice it is looking
for. IMDSv2 wants a session token (``PUT /latest/api/token``) on every read;
it is cached and renewed before its TTL runs out, and a 401 (the service
forgot it, e.g. after a restart) fetches a new one once.

Answers that cannot be parsed are reported in the notice (``problem``) rather
than dropped: an instance-action document exists only when AWS means to take
the instance, so a garbled one is taken as a terminate with an unknown
deadline (see :func:`parse_instance_action`).
"""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Mapping

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "ELASTIC_FT_IMDS_ENDPOINT"
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
ACTIONS = ("terminate", "stop", "hibernate")
MAX_ANSWER_BYTES = 64 * 1024  # the documents are ~60 bytes; never read an unbounded body


class EndpointError(ValueError):
    """``ELASTIC_FT_IMDS_ENDPOINT`` is not an http(s)://host[:port] address."""


class ImdsUnavailable(OSError):
    """Nothing answered at the endpoint within the timeout (connection refused, timed out, no route)."""


class ImdsError(RuntimeError):
    """The service answered, but not as IMDSv2 does (an unexpected status)."""


@dataclasses.dataclass(frozen=True)
class InstanceAction:
    action: str
    """terminate, stop or hibernate (terminate when the document could not be read)."""
    time: float | None
    """When AWS acts, in epoch seconds; None when unknown (the document's time was missing or garbled)."""
    problem: str | None = None
    """Why the document was not taken as written, if it was not."""


@dataclasses.dataclass(frozen=True)
class Rebalance:
    notice_time: float | None
    """When the recommendation was issued, in epoch seconds; None when unreadable."""
    problem: str | None = None
    raw: str = ""
    """The document as served: identifies one recommendation when its time is unreadable."""


def endpoint_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """The IMDS endpoint to use, ``scheme://host[:port]``; :class:`EndpointError` with one line if malformed."""
    text = environ.get(ENDPOINT_ENV, "").strip() or DEFAULT_ENDPOINT
    return check_endpoint(text)


def check_endpoint(text: str) -> str:
    """``text`` normalised (no trailing slash) if it is http(s)://host[:port]; :class:`EndpointError` otherwise."""
    what = f"{ENDPOINT_ENV}={text!r} must look like http://host[:port] (default {DEFAULT_ENDPOINT})"
    try:
        u = urllib.parse.urlsplit(text)
        port = u.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        raise EndpointError(f"{what}: {exc}") from None
    if u.scheme not in ("http", "https"):
        raise EndpointError(f"{what}: the scheme must be http or https")
    if not u.hostname or u.username or u.password:
        raise EndpointError(f"{what}: it needs a host and no user name")
    if u.path not in ("", "/") or u.query or u.fragment:
        raise EndpointError(f"{what}: no path, query or fragment")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{u.scheme}://{host}" + (f":{port}" if port is not None else "")


def parse_time(text: object) -> float:
    """An ISO 8601 UTC time such as ``2026-12-01T04:10:00Z`` as epoch seconds; ValueError otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"time must be a string, got {text!r}")
    when = datetime.datetime.fromisoformat(text)
    if when.tzinfo is None:
        raise ValueError(f"time {text!r} has no time zone")
    return when.timestamp()


def parse_instance_action(body: str) -> InstanceAction:
    """The instance-action document; never raises.

    The document exists only when AWS is about to take the instance, so any
    answer that cannot be read is the safest thing it can be: a terminate with
    an unknown deadline, which makes the job commit and leave at once. Taking
    it for "no notice" could lose every step since the last checkpoint; taking
    it for a notice costs one checkpoint and a restart that loses nothing. An
    unknown action (AWS adds one) is a terminate for the same reason.
    """
    try:
        doc = json.loads(body)
    except ValueError:
        return InstanceAction("terminate", None, f"not JSON: {body[:80]!r}")
    if not isinstance(doc, dict):
        return InstanceAction("terminate", None, f"not a JSON object: {body[:80]!r}")
    action = doc.get("action")
    problem = None if action in ACTIONS else f"unknown action {action!r}"
    action = action if action in ACTIONS else "terminate"
    try:
        when = parse_time(doc.get("time"))
    except ValueError as exc:
        return InstanceAction(action, None, "; ".join(filter(None, [problem, f"bad time: {exc}"])))
    return InstanceAction(action, when, problem)


def parse_rebalance(body: str) -> Rebalance:
    """The rebalance document; never raises (a garbled one is still a recommendation, of unknown time)."""
    try:
        doc = json.loads(body)
        when = parse_time(doc.get("noticeTime") if isinstance(doc, dict) else None)
    except ValueError as exc:
        return Rebalance(None, f"unreadable rebalance recommendation ({exc}): {body[:80]!r}", raw=body[:200])
    return Rebalance(when, raw=body[:200])


class ImdsClient:
    """Reads the spot notices; one instance per watcher thread (not thread-safe)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 1.0, token_ttl_s: int = 21600,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint, self.timeout_s, self.token_ttl_s, self.clock = endpoint, timeout_s, token_ttl_s, clock
        # No proxies: IMDS is link-local, and a proxy would answer for it (or hang).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_expires = 0.0
        self.tokens_fetched = 0

    def instance_action(self) -> InstanceAction | None:
        """The pending instance action, or None (404: no notice)."""
        body = self._read(INSTANCE_ACTION_PATH)
        return None if body is None else parse_instance_action(body)

    def rebalance(self) -> Rebalance | None:
        """The rebalance recommendation, or None (404: none issued)."""
        body = self._read(REBALANCE_PATH)
        return None if body is None else parse_rebalance(body)

    def metadata(self, path: str) -> str | None:
        """Any metadata document, e.g. ``/latest/meta-data/instance-type``; None if absent (404)."""
        return self._read(path)

    def token(self) -> str:
        """The session token, fetched anew when less than a tenth of its TTL (at most a minute) is left."""
        margin = min(60.0, self.token_ttl_s / 10)
        if self._token is None or self.clock() >= self._token_expires - margin:
            started = self.clock()
            status, body = self._request("PUT", TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds":
                                                             str(self.token_ttl_s)})
            if status != 200 or not body.strip():
                raise ImdsError(f"IMDS at {self.endpoint} answered {status} to a token request")
            self._token, self._token_expires = body.strip(), started + self.token_ttl_s
            self.tokens_fetched += 1
        return self._token

    def _read(self, path: str) -> str | None:
        for attempt in (1, 2):
            status, body = self._request("GET", path, {"X-aws-ec2-metadata-token": self.token()})
            if status == 401 and attempt == 1:
                self._token = None  # the service no longer knows our token: get a new one, once
                continue
            if status == 404:
                return None
            if status == 200:
                return body
            raise ImdsError(f"IMDS at {self.endpoint} answered {status} to GET {path}")
        raise AssertionError("unreachable")  # pragma: no cover

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        req = urllib.request.Request(self.endpoint + path, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read(MAX_ANSWER_BYTES).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code, ""
        except http.client.HTTPException as exc:  # something answered, but not in HTTP
            raise ImdsError(f"IMDS at {self.endpoint} gave a malformed answer to {method} {path}: {exc!r}") from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, timed out, no route, reset
            reason = getattr(exc, "reason", exc)
            raise ImdsUnavailable(f"no answer from IMDS at {self.endpoint} within {self.timeout_s:g} s: {reason}") \
                from exc
