"""A new node's model fetch: one ``s3://`` object into the input cache's file, three ways, and a restart.

Against a SeaweedFS (``weed mini``) started by this script on 127.0.0.1
(``tests/checkpoint/s3_servers.py``), one object of ``--mb`` random bytes
(a model's safetensors shard), each way timed in the same run:

(1) single stream: what ``inputs/remote.py`` did before ranged GETs, one GET
    pinned to the ETag, its body read in 1 MiB chunks, sha256'd and written
    to a file, then fsynced (the baseline: ratio 1.00);
(2) parallel ranged GETs: today's ``RemoteInputs.download`` (the checkpoint
    store's ranged reads into the file: each range read into its worker's
    buffer, hashed chunk by chunk and written at its offset with ``pwrite``,
    then fsynced), with the ``checkpoint.s3`` part size and concurrency;
(3) the checkpoint store's read path: ``S3Store.get_verified`` of the same
    bytes (ranged GETs into memory, each 1 MiB chunk hashed as it lands), what
    a checkpoint load costs per byte; no file written.

Then (4) a restart on a node that holds the copy: a new ``InputSource``
resolving the cached object again (its client, a HEAD, then a stat against the
stamp recorded with the digest), against what the cache did before stamps
(the same, plus a sha256 read of the whole file, timed alone and added).

Each timing is repeated (``--repeats``) alternating the ways, the median is
reported; before each, dirty pages are flushed and the server left to go idle
(untimed), and the previous file removed. MB/s are 10**6 bytes per second.

    python bench/model_fetch.py [--mb 256] [--repeats 3] [--part-mb N] [--concurrency N]

On a small, shared machine the server and the client share the cores, so the
ratios move with the load of other processes; the load average is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import statistics
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))

from checkpoint import settle, use_server  # noqa: E402 (bench/checkpoint.py: flush, then wait for an idle server)

MB = 1_000_000
MiB = 1 << 20


def single_stream(client, bucket: str, key: str, etag: str, size: int, dest: str) -> str:
    """The fetch before ranged GETs (inputs/remote.py's ``_download_once``, kept here as the baseline)."""
    resp = client.get_object(Bucket=bucket, Key=key, IfMatch=f'"{etag}"')
    digest, written = hashlib.sha256(), 0
    with open(dest, "wb") as f:
        for chunk in resp["Body"].iter_chunks(MiB):
            written += len(chunk)
            f.write(chunk)
            digest.update(chunk)
        assert written == size, f"{written} of {size} bytes"
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process (all its threads), or by process ``pid``."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def upload(endpoint, path: str, key: str) -> None:
    import boto3

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint.endpoint_url, aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=endpoint.secret_key, region_name=endpoint.region)
    client.upload_file(path, endpoint.bucket, key)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=256, help="object size in MB (a model shard; 1000 for the README)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each way (median reported)")
    p.add_argument("--part-mb", type=float, default=None, help="ranged-GET size in MiB (default: checkpoint.s3's)")
    p.add_argument("--concurrency", type=int, default=None, help="ranged GETs in flight (default: checkpoint.s3's)")
    args = p.parse_args(argv)
    if not 1 <= args.mb <= 64_000 or not 1 <= args.repeats <= 50:
        p.error("--mb must be 1..64000 and --repeats 1..50")

    import logging

    logging.basicConfig(level=logging.WARNING)
    from s3_servers import SeaweedServer

    from elastic_ft.checkpoint.digest import CHUNK_SIZE, blob_sha256, file_blob_sha256
    from elastic_ft.checkpoint.s3 import S3Store
    from elastic_ft.checkpoint.s3.client import make_client
    from elastic_ft.checkpoint.s3.options import S3Options
    from elastic_ft.inputs.remote import RemoteInputs
    from elastic_ft.inputs.resolve import InputSource
    from elastic_ft.inputs.settings import InputsConfig
    from elastic_ft.inputs.uri import parse_object_uri

    size = int(args.mb * MB)
    given = {}
    if args.part_mb:
        given["download_part_size"] = int(args.part_mb * MiB)
    if args.concurrency:
        given["max_concurrency"] = args.concurrency
    options = S3Options.resolve(given)
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp:
        server = SeaweedServer(os.path.join(tmp, "seaweedfs"))
        endpoint = server.start()
        use_server(endpoint)
        print(f"SeaweedFS at {endpoint.endpoint_url}; {os.cpu_count()} CPUs; load average "
              f"{os.getloadavg()[0]:.1f}; object {size / MB:.0f} MB; ranged GETs of "
              f"{options.download_part_size / MiB:g} MiB, {options.max_concurrency} in flight", flush=True)
        remote = store = None
        try:
            prefix = f"models/{uuid.uuid4().hex[:8]}/"
            key = prefix + "model.safetensors"
            src = os.path.join(tmp, "source.bin")
            with open(src, "wb") as f:  # random: nothing on the way can compress it
                left = size
                while left:
                    f.write(os.urandom(min(left, 64 * MiB)))
                    left -= min(left, 64 * MiB)
            upload(endpoint, src, key)
            with open(src, "rb") as f:
                data = f.read()
            plain, chunked = hashlib.sha256(data).hexdigest(), blob_sha256(data, CHUNK_SIZE)
            del data
            os.remove(src)

            remote = RemoteInputs(options)
            loc = parse_object_uri(f"s3://{endpoint.bucket}/{key}")
            obj = remote.head(loc, "model.safetensors")
            client = make_client(options)
            store = S3Store.from_uri(f"s3://{endpoint.bucket}/{prefix.rstrip('/')}",
                                     **{k: v for k, v in dataclasses.asdict(options).items() if v is not None})
            dest = os.path.join(tmp, "model.safetensors")

            def one_stream() -> None:
                assert single_stream(client, endpoint.bucket, key, obj.etag, size, dest) == plain

            def ranged() -> None:
                assert remote.download(endpoint.bucket, obj, dest) == chunked

            def checkpoint_path() -> None:
                view = store.get_verified("model.safetensors", size=size, sha256=chunked, chunk_size=CHUNK_SIZE)
                assert len(view) == size

            ways = {"single stream (before)": one_stream, "parallel ranged GETs": ranged,
                    "checkpoint store's read": checkpoint_path}
            times: dict[str, list[float]] = {name: [] for name in ways}
            cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
            for name, fn in ways.items():  # warm-up, untimed: connections, imports, the server's caches
                fn()
            for _ in range(args.repeats):
                for name, fn in ways.items():
                    if os.path.exists(dest):
                        os.remove(dest)
                    settle(server.pid)
                    mine, theirs, start = cpu_s(), cpu_s(server.pid), time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append((cpu_s() - mine, cpu_s(server.pid) - theirs))
            base = statistics.median(times["single stream (before)"])
            print(f"\n(1)-(3) fetch of {size / MB:.0f} MB (median of {args.repeats}; ratio: single stream's time "
                  "over this way's; CPU seconds per GB of this process and of the server, medians)")
            for name, ts in times.items():
                t = statistics.median(ts)
                per_gb = 1000 * MB / size
                client_cpu = statistics.median(c for c, _ in cpu[name]) * per_gb
                server_cpu = statistics.median(s for _, s in cpu[name]) * per_gb
                print(f"  {name:28s} {t:7.2f} s  {size / MB / t:8.1f} MB/s  ratio {base / t:5.2f}  "
                      f"CPU/GB {client_cpu:5.2f} + {server_cpu:5.2f} s  [{', '.join(f'{x:.2f}' for x in ts)}]")

            # (4) a restart on the node: the copy cached by a first resolve, then resolved again.
            cache_dir = os.path.join(tmp, "cache")
            uri = f"s3://{endpoint.bucket}/{key}"
            with InputSource(InputsConfig(cache_dir=cache_dir), options) as source:
                path = source.file(uri, "data.files[0]")
            restart, rehash = [], []
            for _ in range(args.repeats):
                settle(server.pid)
                start = time.perf_counter()
                with InputSource(InputsConfig(cache_dir=cache_dir), options) as source:
                    assert source.file(uri, "data.files[0]") == path and source.fetched[uri] == []
                restart.append(time.perf_counter() - start)
                settle(server.pid)
                start = time.perf_counter()  # what the cache added before stamps: a sha256 read of the whole file
                fd = os.open(path, os.O_RDONLY)
                try:
                    assert file_blob_sha256(fd, 0, size, 0) == plain
                finally:
                    os.close(fd)
                rehash.append(time.perf_counter() - start)
            r, h = statistics.median(restart), statistics.median(rehash)
            print(f"\n(4) restart on a node holding the copy: a new InputSource resolving it (client, HEAD, "
                  f"stat; median of {args.repeats}; the file in page cache)")
            print(f"  now (the stamp matches)              {r:7.3f} s")
            print(f"  before (the same + a sha256 read)    {r + h:7.3f} s  ({size / MB / h:.0f} MB/s hashed)")
        finally:
            if remote is not None:
                remote.close()
            if store is not None:
                store.close()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
