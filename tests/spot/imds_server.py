"""A local IMDSv2 on 127.0.0.1 for tests: session tokens and the two spot documents, switchable at runtime.

It behaves as EC2's service does for what the watcher uses: ``PUT
/latest/api/token`` with a TTL header (1 to 21600) gives a token, every GET
needs a live token (401 otherwise), and a document that is not set answers
404. Tests switch the documents, expire tokens or make it answer an error
while it runs; counters let them wait for the client's requests.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid

from elastic_ft.spot.imds import INSTANCE_ACTION_PATH, REBALANCE_PATH, TOKEN_PATH


class FakeImds:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.documents: dict[str, str] = {}
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.token_puts = 0
        self.gets = 0
        self.unauthorized = 0
        self.fail_status: int | None = None  # answer every request with this status while set
        self.fail_paths: dict[str, int] = {}  # answer GETs of these documents with these statuses
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-imds", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeImds":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ switches

    def set_instance_action(self, doc: dict | str | None) -> None:
        """Serve this instance-action document (a dict is written as JSON; None: 404)."""
        self._set(INSTANCE_ACTION_PATH, doc)

    def set_rebalance(self, doc: dict | str | None) -> None:
        self._set(REBALANCE_PATH, doc)

    def expire_tokens(self) -> None:
        """Forget every token issued so far (as after an IMDS restart): their next GET gets 401."""
        with self._lock:
            self.tokens.clear()

    def counts(self) -> tuple[int, int]:
        """(token PUTs, document GETs answered 200 or 404) so far."""
        with self._lock:
            return self.token_puts, self.gets

    def _set(self, path: str, doc: dict | str | None) -> None:
        with self._lock:
            if doc is None:
                self.documents.pop(path, None)
            else:
                self.documents[path] = doc if isinstance(doc, str) else json.dumps(doc)


def _handler(imds: FakeImds):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _reply(self, decide) -> None:  # type: ignore[no-untyped-def]
            """Answer with ``decide()``'s (status, body), decided under the fake's lock (or its failure)."""
            with imds._lock:
                status, body = (imds.fail_status, "") if imds.fail_status is not None else decide()
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            self._reply(self._token)

        def do_GET(self) -> None:
            self._reply(self._document)

        def _token(self) -> tuple[int, str]:
            if self.path != TOKEN_PATH:
                return 403, ""
            try:
                ttl = int(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                return 400, ""
            if not 1 <= ttl <= 21600:
                return 400, ""
            token = uuid.uuid4().hex
            imds.tokens[token] = time.monotonic() + ttl
            imds.token_puts += 1
            return 200, token

        def _document(self) -> tuple[int, str]:
            expiry = imds.tokens.get(self.headers.get("X-aws-ec2-metadata-token", ""))
            if expiry is None or expiry < time.monotonic():
                imds.unauthorized += 1
                return 401, ""
            if self.path in imds.fail_paths:
                return imds.fail_paths[self.path], ""
            imds.gets += 1
            body = imds.documents.get(self.path)
            return (404, "") if body is None else (200, body)

    return Handler
