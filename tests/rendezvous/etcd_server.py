"""A real etcd process for tests: free 127.0.0.1 ports, a temp data dir, TLS and auth.

``EtcdServer`` starts the Debian ``etcd`` binary (3.4) as a single-member
cluster, waits until it answers, and can be stopped, restarted on the same
ports and data dir, or given users and auth. ``make_tls_files`` writes a CA and
a server/client certificate pair with the ``cryptography`` package.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port, free_ports  # noqa: F401  (free_port: for the tests)
from tests.waiting import wait_until

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"

# The root password of the auth-enabled test member.
ROOT_PASSWORD = "s3cret-root"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: a CA, a server pair for 127.0.0.1, a client pair."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_tls_files(directory: Path) -> TlsFiles:
    """Write a throw-away CA plus server and client certificates into ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pem(key) -> bytes:  # type: ignore[no-untyped-def]
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastic-ft test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(name: str, usage) -> tuple[bytes, bytes]:  # type: ignore[no-untyped-def]
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    server_cert, server_key = leaf(
        "etcd", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    client_cert, client_key = leaf("elastic-ft-client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    files = {
        "ca.pem": ca_cert.public_bytes(serialization.Encoding.PEM),
        "server.pem": server_cert,
        "server-key.pem": server_key,
        "client.pem": client_cert,
        "client-key.pem": client_key,
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return TlsFiles(
        ca_cert=str(directory / "ca.pem"),
        server_cert=str(directory / "server.pem"),
        server_key=str(directory / "server-key.pem"),
        client_cert=str(directory / "client.pem"),
        client_key=str(directory / "client-key.pem"),
    )


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own data dir.

    Args:
        data_dir: where etcd keeps its data (kept across :meth:`restart`).
        tls: serve clients over TLS and require client certificates.
        extra_args: more etcd flags (bench/control_plane.py: compaction and quota as the infra
            template sets them).
    """

    def __init__(self, data_dir: Path, tls: TlsFiles | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.data_dir = Path(data_dir)
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.client_port, self.peer_port = free_ports(2)
        self.process: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.root_password: str | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def start(self, timeout: float = 30.0) -> "EtcdServer":
        """Start the member (again, after :meth:`stop` or :meth:`kill`: same ports, same data).

        etcd must be told its ports, so they are picked free just before: another process may bind
        one in between. A first start that fails to bind is retried on new ports (up to three
        times); a restart keeps its ports, which the member's data and its clients remember.
        """
        first = not self.data_dir.exists()
        for attempt in range(3):
            try:
                return self._start(timeout)
            except RuntimeError:
                if not first or attempt == 2 or "address already in use" not in self._log_tail():
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.client_port, self.peer_port = free_ports(2)
        raise AssertionError("unreachable")

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def _start(self, timeout: float) -> "EtcdServer":
        url = f"{self.scheme}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            ETCD,
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", url,
            "--advertise-client-urls", url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            # Keep the test member light on 2 cores and quick to elect itself.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-level", "warn",
            *self.extra_args,
        ]
        if self.tls:
            cmd += [
                "--cert-file", self.tls.server_cert,
                "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca_cert,
                "--client-cert-auth",
            ]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.wait_healthy(timeout)
        return self

    def etcdctl(self, *args: str, user: bool = True, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [ETCDCTL, f"--endpoints={self.scheme}://{self.endpoint}", "--dial-timeout=2s"]
        if self.tls:
            cmd += [
                f"--cacert={self.tls.ca_cert}",
                f"--cert={self.tls.client_cert}",
                f"--key={self.tls.client_key}",
            ]
        if user and self.root_password:
            cmd += [f"--user=root:{self.root_password}"]
        env = dict(os.environ, ETCDCTL_API="3")
        return subprocess.run(
            cmd + list(args), capture_output=True, text=True, env=env, check=check, timeout=30
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        def running() -> None:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.process.returncode} at start; see {self.log_path}:\n" + self._log_tail()
                )

        # A plain read needs a leader, unlike "endpoint health" with auth on.
        wait_until(lambda: self.etcdctl("get", "/health-probe", check=False).returncode == 0, timeout=timeout,
                   what=f"etcd at {self.endpoint} to serve reads", check=running)

    def enable_auth(self, password: str) -> None:
        """Create user root with ``password`` and turn authentication on."""
        self.etcdctl("user", "add", f"root:{password}", "--interactive=false")
        self.etcdctl("auth", "enable")
        self.root_password = password

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the member, like a crash."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
