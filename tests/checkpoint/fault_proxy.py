"""A programmable HTTP fault proxy between boto3 and a real S3 server (tests only).

The client's ``endpoint_url`` points at the proxy; each request is forwarded
unchanged (Host header included, so SigV4 signatures still verify upstream)
unless a rule matches it. Rules are deterministic: "the next N requests with
method M whose path matches regex R" get one fault:

- ``slowdown``: answer 503 SlowDown without forwarding;
- ``drop_before``: close the connection without forwarding (nothing reached S3);
- ``drop_after``: forward, read the server's full answer, then close the
  connection without replying (the server committed; the client cannot know);
- ``truncate``: forward, then send the status, headers and only the first
  ``keep`` bytes of the body before closing (Content-Length promises more);
- ``delay``: wait ``seconds`` before forwarding;
- ``error``: answer HTTP ``status`` with S3 error ``code`` without forwarding
  (default 403 AccessDenied, what S3 says to a key or policy that refuses).

Every request is recorded (method, path, Range header, fault applied) so tests
can assert what happened, e.g. that a download was made of ranged GETs.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import re
import socket
import struct
import threading
import urllib.parse

from tests.process_guard import started

FAULTS = ("slowdown", "drop_before", "drop_after", "truncate", "delay", "error")

_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>fault-proxy</RequestId></Error>"
)

_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>Injected by the fault proxy.</Message>"
    "<RequestId>fault-proxy</RequestId></Error>"
)

# Hop-by-hop headers are the proxy's own business, never forwarded.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}


@dataclasses.dataclass
class Rule:
    """Apply ``fault`` to the next ``times`` requests matching ``method`` and ``path``."""

    fault: str
    method: str | None = None
    path: str = ""
    times: int = 1
    seconds: float = 0.0
    keep: int = 0
    status: int = 403
    code: str = "AccessDenied"
    hits: int = 0

    def matches(self, method: str, target: str) -> bool:
        if self.hits >= self.times:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        return re.search(self.path, target) is not None


@dataclasses.dataclass(frozen=True)
class Seen:
    """One request as the proxy saw it."""

    method: str
    path: str
    range: str | None
    fault: str | None


class FaultProxy:
    """The proxy server: ``start()``, point a client at ``url``, add rules, ``stop()``."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self.upstream_host = parsed.hostname or "127.0.0.1"
        self.upstream_port = parsed.port or 80
        self._rules: list[Rule] = []
        self._seen: list[Seen] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    # -- control ---------------------------------------------------------------

    def start(self) -> FaultProxy:
        started("s3server", "the S3 fault proxy")
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes any delay in progress
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:  # keep-alive connections would otherwise idle on
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)

    def add(self, fault: str, *, method: str | None = None, path: str = "", times: int = 1, **params) -> Rule:
        """Add a rule; rules are tried in the order added, the first match applies."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
        rule = Rule(fault=fault, method=method, path=path, times=times, **params)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._seen.clear()

    @property
    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def _pick(self, method: str, target: str, range_header: str | None) -> Rule | None:
        with self._lock:
            rule = next((r for r in self._rules if r.matches(method, target)), None)
            if rule is not None:
                rule.hits += 1
            self._seen.append(Seen(method, target, range_header, rule.fault if rule else None))
            return rule


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        pass  # quiet: tests read ``seen`` instead

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the connection was dropped on purpose
        with self.owner._lock:
            self.owner._sockets.discard(self.connection)

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _drop(self) -> None:
        """Reset the connection (SO_LINGER 0): the client sees it die mid-exchange."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _proxy(self) -> None:
        body = self._read_body()  # BaseHTTPRequestHandler already answered any Expect: 100-continue
        rule = self.owner._pick(self.command, self.path, self.headers.get("Range"))
        fault = rule.fault if rule else None
        if fault == "slowdown":
            self._reply(503, [("Content-Type", "application/xml")], _SLOWDOWN_BODY)
            return
        if fault == "error":
            body = _ERROR_BODY.format(code=rule.code).encode()
            self._reply(rule.status, [("Content-Type", "application/xml")], body)
            return
        if fault == "drop_before":
            self._drop()
            return
        if fault == "delay":
            if self.owner._stopping.wait(rule.seconds):
                self._drop()
                return
        try:
            status, headers, payload = self._forward(body)
        except OSError:
            self._drop()  # upstream failed: look like a dead server, not a proxy bug
            return
        if fault == "drop_after":
            self._drop()
            return
        if fault == "truncate":
            self._reply(status, headers, payload[: rule.keep], content_length=len(payload))
            self._drop()
            return
        self._reply(status, headers, payload)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.owner.upstream_host, self.owner.upstream_port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            payload = resp.read()  # http.client undoes chunking; we re-send with Content-Length
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
            return resp.status, headers, payload
        finally:
            conn.close()

    def _reply(
        self, status: int, headers: list[tuple[str, str]], payload: bytes, *, content_length: int | None = None
    ) -> None:
        self.send_response_only(status)
        has_length = False
        for name, value in headers:
            if name.lower() == "content-length":
                has_length = True
                if content_length is not None:
                    value = str(content_length)
            self.send_header(name, value)
        if not has_length and self.command != "HEAD" and status not in (204, 304):
            self.send_header("Content-Length", str(content_length if content_length is not None else len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
        self.wfile.flush()
