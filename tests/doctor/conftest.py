"""Fixtures of the doctor tests (the real etcd and S3 servers are the session's, tests/servers.py): a local IMDS,
an S3 stub.

Everything listens on 127.0.0.1. The S3 "ignorer" is a stub that answers every
PUT 200, as an S3-compatible server without conditional writes does; its
``Date`` header can be skewed to test the clock check.
"""

from __future__ import annotations

import email.utils
import http.server
import itertools
import os
import shutil
import threading
import time

import pytest

from tests.spot.imds_server import FakeImds

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian etcd-server)")

_ids = itertools.count()


@pytest.fixture
def run_id() -> str:
    return f"doctor-{os.getpid()}-{next(_ids)}"


class IgnoringS3:
    """An S3 stub that ignores ``If-None-Match``: every PUT answers 200; HEAD 200; DELETE 204.

    ``skew_s`` shifts the ``Date`` header it sends (seconds; negative: the server is behind).
    """

    def __init__(self) -> None:
        self.skew_s = 0.0
        self.puts: list[tuple[str, str | None]] = []  # (path, If-None-Match)
        self.deletes: list[str] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _stub_handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _stub_handler(stub: IgnoringS3):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def date_time_string(self, timestamp=None) -> str:
            return email.utils.formatdate(time.time() + stub.skew_s, usegmt=True)

        def _empty(self, status: int) -> None:
            self.send_response(status)
            self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            stub.puts.append((self.path, self.headers.get("If-None-Match")))
            self._empty(200)

        def do_HEAD(self) -> None:
            self._empty(200)

        def do_DELETE(self) -> None:
            stub.deletes.append(self.path)
            self._empty(204)

    return Handler


@pytest.fixture
def ignoring_s3():
    stub = IgnoringS3()
    yield stub
    stub.stop()


@pytest.fixture
def s3_env(monkeypatch, tmp_path):
    """Isolate boto3 from the developer's AWS config; return a function that points it at an endpoint URL."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                 "ELASTIC_FT_S3_SSE", "ELASTIC_FT_S3_SSE_KMS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    def use(endpoint_url: str, access_key: str = "testing", secret_key: str = "testing") -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_key)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint_url)

    return use


@pytest.fixture
def imds():
    server = FakeImds().start()
    yield server
    server.stop()
