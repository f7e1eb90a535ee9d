"""Checkpoint cost: commit and load throughput against plain boto3, and how long the
training loop is blocked per asynchronous checkpoint.

Everything runs against a SeaweedFS (``weed mini``) started by this script on
127.0.0.1 (``tests/checkpoint/s3_servers.py``), so the figures compare our code
with boto3 on the same server, in one run:

(a) commit throughput: bytes committed per second by
    ``CheckpointWriter.commit`` of a snapshot (serialise to safetensors, hash,
    upload every blob, write the manifest) for LoRA-sized (``--lora-mb``) and
    full-model-sized (``--big-mb``) state, against boto3's ``upload_file`` of
    the same bytes (the serialised blobs, from a file on local disk) to the
    same server. Target: ratio >= 0.9.
(b) blocked time: the real ``Trainer`` (world 1, the tiny LoRA spec) saving
    asynchronously to ``s3://`` every few steps; the median ``blocked_s`` of its
    ``checkpoint_committed`` events over the median step time. Target <= 2%.
(c) load throughput: ``reader.load_blobs`` of the newest checkpoint (ranged
    GETs, each 1 MiB chunk's sha256 taken as it lands, safetensors parse) against boto3's
    ``download_fileobj`` of the same objects into memory. Target >= 0.9.

(d) sharded against replicated (``--fsdp-mb`` of state, the same bytes both
    ways): saved at 2 ranks (torchrun) as FSDP2 DTensors through DCP
    (``checkpoint.sharded.save_sharded``: each rank one blob of its shards)
    and as today's replicated parts (each rank uploads half of the full
    tensors), then loaded at 3 ranks and at 1 (sharded: resharded into this
    world's shards, each rank fetching only the blobs it reads; replicated:
    every rank loads the whole checkpoint, as a replicated resume does).
    Ratios are sharded throughput over replicated (> 1: sharded is faster).

Each timing is repeated (``--repeats``) alternating ours and boto3's, and the
median is reported, so load from other processes on the machine hits both;
before each timing dirty pages are flushed and the server left to go idle
(untimed).

    python bench/checkpoint.py [--lora-mb 20] [--big-mb 1024] [--repeats 7] [--big-repeats 5] [--steps 60]
                               [--trainer-store s3|file] [--part-mb N] [--download-part-mb N] [--fsdp-mb 256]
                               [--fsdp-repeats 3] [--skip a,b,d]

On a small, shared machine the uploads are CPU-bound (SigV4 hashes every
payload over plain HTTP, and SeaweedFS runs on the same cores), so the ratios
move with the load from other processes; the load average is printed first.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))

MB = 1_000_000
MiB = 1 << 20


def make_tensors(total_mb: float, tensor_mb: float):
    """``total_mb`` of float32 tensors of about ``tensor_mb`` each, as a model/optimizer pair."""
    import torch

    n_total = int(total_mb * MB / 4)
    per = max(1, int(tensor_mb * MB / 4))
    model, optim, i = {}, {}, 0
    while n_total > 0:
        n = min(per, n_total)
        t = torch.randn(n)
        (model if i % 3 else optim)[f"layers.{i}.weight"] = t
        n_total -= n
        i += 1
    return {"model": model, "optimizer": optim}


def boto3_client(endpoint):
    """A plain boto3 client as a user would build it (default retries and pool)."""
    import boto3

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint.endpoint_url, aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=endpoint.secret_key, region_name=endpoint.region,
    )


def median(xs):
    return statistics.median(xs)


def fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def settle(server_pid: int, busy_below: float = 0.05, window: float = 0.5, timeout: float = 60.0) -> None:
    """Flush dirty pages, then wait (bounded) until the S3 server is idle.

    Untimed, before each timing: after a gigabyte is written or deleted the server
    keeps working in the background (writing back, deleting chunks) for seconds,
    and that must not land on whichever side happens to run next.
    """
    os.sync()
    tick = os.sysconf("SC_CLK_TCK")

    def cpu_s() -> float:
        with open(f"/proc/{server_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_s()
        time.sleep(window)
        if cpu_s() - before < busy_below * window:
            return


def bench_commit_and_load(endpoint, server_pid: int, label: str, total_mb: float, tensor_mb: float, repeats: int,
                          tmp: str, store_options: dict):
    from safetensors.torch import save as save_safetensors

    from elastic_ft.checkpoint.reader import load_blobs
    from elastic_ft.checkpoint.s3 import S3Store
    from elastic_ft.checkpoint.writer import CheckpointWriter, snapshot

    tensors = make_tensors(total_mb, tensor_mb)
    snap = snapshot(1, 0, tensors, documents={"trainer": {"step": 1}}, config_hash="bench")
    # The same bytes the writer commits, as files on local disk for boto3's upload_file (untimed).
    files = []
    for name, group in tensors.items():
        path = os.path.join(tmp, f"{label}-{name}.safetensors")
        with open(path, "wb") as f:
            f.write(save_safetensors(group))
        files.append(path)
    ours_up, base_up, ours_down, base_down = [], [], [], []
    committed_bytes = 0
    for r in range(repeats):
        prefix = f"bench/{label}-{uuid.uuid4().hex[:8]}"
        # A new store and a new boto3 client each round, as a job builds them
        # when it starts: neither side loads through connections and threads
        # that earlier rounds warmed.
        store = S3Store.from_uri(f"s3://{endpoint.bucket}/{prefix}", endpoint_url=endpoint.endpoint_url,
                                 **store_options)
        client = boto3_client(endpoint)
        keys = [f"{prefix}-boto3/{os.path.basename(path)}" for path in files]
        snap.step = r + 1
        manifest = None

        def commit():
            nonlocal manifest
            t = time.perf_counter()
            manifest = CheckpointWriter(store, "bench").commit(snap)
            ours_up.append(time.perf_counter() - t)

        def upload():
            t = time.perf_counter()
            for path, key in zip(files, keys):
                client.upload_file(path, endpoint.bucket, key)
            base_up.append(time.perf_counter() - t)

        def load():
            t = time.perf_counter()
            loaded = load_blobs(store, manifest)
            ours_down.append(time.perf_counter() - t)
            assert sum(len(g) for g in loaded.tensors.values()) == sum(len(g) for g in tensors.values())

        def download():
            t = time.perf_counter()
            for key in keys:
                client.download_fileobj(endpoint.bucket, key, io.BytesIO())
            base_down.append(time.perf_counter() - t)

        # Alternate which goes first, so drift on a busy machine hits both alike,
        # and let the server settle before each timing (see settle()).
        for fn in ((commit, upload, load, download) if r % 2 == 0 else (upload, commit, download, load)):
            settle(server_pid)
            fn()
        committed_bytes = manifest.total_size
        for ref in manifest.blobs.values():
            store.delete(ref.key)
        for key in keys:
            client.delete_object(Bucket=endpoint.bucket, Key=key)
        store.close()
    for path in files:
        os.unlink(path)

    up_ours, up_base = committed_bytes / median(ours_up), committed_bytes / median(base_up)
    down_ours, down_base = committed_bytes / median(ours_down), committed_bytes / median(base_down)
    mb = committed_bytes / MB
    print(f"(a) commit {label} ({mb:.1f} MB): CheckpointWriter.commit {up_ours / MB:.1f} MB/s "
          f"(median {median(ours_up):.2f} s) | boto3 upload_file {up_base / MB:.1f} MB/s "
          f"(median {median(base_up):.2f} s) | ratio {up_ours / up_base:.2f} (target >= 0.9)", flush=True)
    print(f"(c) load {label} ({mb:.1f} MB): reader.load_blobs {down_ours / MB:.1f} MB/s "
          f"(median {median(ours_down):.2f} s) | boto3 download_fileobj {down_base / MB:.1f} MB/s "
          f"(median {median(base_down):.2f} s) | ratio {down_ours / down_base:.2f} (target >= 0.9)", flush=True)
    print(f"    {label} samples (s): commit {fmt(ours_up)} upload_file {fmt(base_up)} | "
          f"load {fmt(ours_down)} download_fileobj {fmt(base_down)}", flush=True)
    return up_ours / up_base, down_ours / down_base


def warm_up(endpoint, tmp: str) -> None:
    """One untimed upload and download of 64 MB through boto3: SeaweedFS allocates its
    first volumes on the first writes, and that cost must not land on whoever goes first."""
    client = boto3_client(endpoint)
    path = os.path.join(tmp, "warm-up")
    with open(path, "wb") as f:
        f.write(os.urandom(64 * MB))
    client.upload_file(path, endpoint.bucket, "bench/warm-up")
    client.download_fileobj(endpoint.bucket, "bench/warm-up", io.BytesIO())
    client.delete_object(Bucket=endpoint.bucket, Key="bench/warm-up")
    os.unlink(path)


def bench_blocked(endpoint, steps: int, every: int, tmp: str, where: str):
    """The real trainer, world 1, saving asynchronously to ``where`` (s3 or file) every ``every`` steps."""
    from elastic_ft.config import load_spec
    from elastic_ft.runevents.events import read_events
    from elastic_ft.train.loop import RunOptions, Trainer
    from elastic_ft.train.world import init_world

    spec = load_spec(os.path.join(ROOT, "specs", "tiny-lora.yaml"), [
        f"steps={steps}", f"checkpoint.every_steps={every}", "checkpoint.async_save=true",
        "checkpoint.keep_last=2", "spot.enabled=false",  # no IMDS polling or SIGTERM handler: as before spot
    ])
    log_dir = os.path.join(tmp, "trainer-logs")
    opts = RunOptions(run_id=f"blocked-{uuid.uuid4().hex[:6]}",
                      checkpoint_uri=f"s3://{endpoint.bucket}/bench-trainer" if where == "s3" else f"file://{tmp}/ckpt",
                      log_dir=log_dir)
    trainer = Trainer(spec, opts, init_world())
    try:
        trainer.run()
    finally:
        trainer.close()
    events = read_events(os.path.join(log_dir, "events.jsonl"))
    step_s = [e["tokens"] / e["tokens_per_s"] for e in events if e["event"] == "step" and e["step"] > 3]
    commits = [e for e in events if e["event"] == "checkpoint_committed"]
    blocked = [e["blocked_s"] for e in commits if e.get("blocked_s") is not None and e["reason"] != "final"]
    if not blocked:
        blocked = [e["blocked_s"] for e in commits if e.get("blocked_s") is not None]
    step, b = median(step_s), median(blocked)
    print(f"(b) blocked per async checkpoint to {where}://: median {b * 1e3:.2f} ms (max {max(blocked) * 1e3:.2f} ms, "
          f"{len(blocked)} saves of {commits[0]['bytes'] / MB:.2f} MB) | median step {step * 1e3:.1f} ms | "
          f"fraction {b / step:.2%} (max {max(blocked) / step:.2%}) (target <= 2%)", flush=True)
    return b / step


def bench_fsdp(endpoint, server_pid: int, total_mb: float, repeats: int, tmp: str):
    """(d): torchrun jobs of bench/checkpoint_fsdp.py: save at 2 ranks, load at 3 and at 1."""
    import json
    import subprocess

    uri = f"s3://{endpoint.bucket}/bench-fsdp-{uuid.uuid4().hex[:8]}"
    out = os.path.join(tmp, "fsdp")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    worker = os.path.join(ROOT, "bench", "checkpoint_fsdp.py")
    for nproc, mode in ((2, "save"), (3, "load"), (1, "load")):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        worker, mode, uri, str(total_mb), str(repeats), out, str(server_pid)],
                       env=env, check=True, cwd=ROOT)
    with open(os.path.join(out, "save.json")) as f:
        saved = json.load(f)
    mb = saved["bytes"] / MB

    def line(what: str, times: dict) -> float:
        rep, shd = median(times["replicated"]), median(times["sharded"])
        print(f"(d) {what} ({mb:.1f} MB): sharded {mb / shd:.1f} MB/s (median {shd:.2f} s) | replicated "
              f"{mb / rep:.1f} MB/s (median {rep:.2f} s) | ratio {rep / shd:.2f} (sharded/replicated throughput)",
              flush=True)
        print(f"    samples (s): sharded {fmt(times['sharded'])} replicated {fmt(times['replicated'])}", flush=True)
        return rep / shd

    ratios = [line(f"save at {saved['world']} ranks", saved["times"])]
    for world in (3, 1):
        with open(os.path.join(out, f"load-{world}.json")) as f:
            loaded = json.load(f)
        assert loaded["equal"], f"the sharded load at {world} ranks gave other values"
        ratios.append(line(f"load saved at {saved['world']}, at {world} rank(s)", loaded["times"]))
    return ratios


def use_server(endpoint) -> None:  # type: ignore[no-untyped-def]
    """Point this process's S3 clients at the bench's server only (no profile, session or SSE setting of
    this machine)."""
    os.environ.update(AWS_ACCESS_KEY_ID=endpoint.access_key, AWS_SECRET_ACCESS_KEY=endpoint.secret_key,
                      AWS_DEFAULT_REGION=endpoint.region, AWS_ENDPOINT_URL_S3=endpoint.endpoint_url,
                      AWS_EC2_METADATA_DISABLED="true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "ELASTIC_FT_S3_SSE", "ELASTIC_FT_S3_SSE_KMS_KEY_ID"):
        os.environ.pop(name, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lora-mb", type=float, default=20, help="LoRA-sized state (MB)")
    p.add_argument("--big-mb", type=float, default=1024, help="full-model-sized state (MB); shrink on small machines")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each commit/load (median reported)")
    p.add_argument("--big-repeats", type=int, default=5, help="repeats for the full-model-sized state")
    p.add_argument("--steps", type=int, default=60, help="trainer steps for (b)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps in (b)")
    p.add_argument("--part-mb", type=float, default=None, help="S3Store multipart part size in MiB (default: the store's)")
    p.add_argument("--download-part-mb", type=float, default=None, help="S3Store ranged-GET size in MiB")
    p.add_argument("--trainer-store", choices=("s3", "file"), default="s3", help="where (b)'s trainer saves")
    p.add_argument("--fsdp-mb", type=float, default=256, help="state (MB) saved sharded and replicated in (d)")
    p.add_argument("--fsdp-repeats", type=int, default=3, help="timed repeats of each save/load in (d)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: a, b, d (c runs with a)")
    args = p.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    from s3_servers import SeaweedServer

    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        server = SeaweedServer(os.path.join(tmp, "seaweedfs"))
        endpoint = server.start()
        use_server(endpoint)
        print(f"SeaweedFS at {endpoint.endpoint_url}; {os.cpu_count()} CPUs; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        try:
            store_options = {}
            if args.part_mb:
                store_options.update(part_size=int(args.part_mb * MiB), multipart_threshold=int(2 * args.part_mb * MiB))
            if args.download_part_mb:
                store_options.update(download_part_size=int(args.download_part_mb * MiB))
            if "a" not in skip:
                warm_up(endpoint, tmp)
                bench_commit_and_load(endpoint, server.pid, "lora", args.lora_mb, 0.5, args.repeats, tmp, store_options)
                bench_commit_and_load(endpoint, server.pid, "full", args.big_mb, 64, args.big_repeats, tmp, store_options)
            if "b" not in skip:
                bench_blocked(endpoint, args.steps, args.every, tmp, args.trainer_store)
            if "d" not in skip:
                bench_fsdp(endpoint, server.pid, args.fsdp_mb, args.fsdp_repeats, tmp)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
