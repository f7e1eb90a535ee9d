"""Saving a checkpoint: snapshot to host memory, upload blobs, commit the manifest.

The commit protocol (DESIGN.md): blobs go to fresh immutable keys under
``blobs/<step>-<nonce>/``; the manifest, naming each blob's size and sha256,
is written last with create-if-absent. Until it lands the checkpoint does not
exist, so a crash at any point leaves at worst orphan blobs for gc.

Saving is split in two so training blocks only for the first half:
:func:`snapshot` copies state to host memory at a step boundary; the upload
and commit run on a background thread (:mod:`elastic_ft.checkpoint.saver`),
spread over the ranks: each uploads one shard (:meth:`CheckpointWriter.upload_part`)
and the leader commits once every part is in.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable

import torch

from elastic_ft.checkpoint.codec import safetensors_segments
from elastic_ft.checkpoint.manifest import (
    BLOB_PREFIX, MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH, BlobRef, Manifest, json_depth_exceeds, manifest_key,
    parse_manifest,
)
from elastic_ft.checkpoint.digest import CHUNK_SIZE, blob_sha256
from elastic_ft.checkpoint.segments import Data
from elastic_ft.checkpoint.store import ObjectExists, ObjectStore

log = logging.getLogger(__name__)


class CheckpointConflict(RuntimeError):
    """Another writer committed this step of this run first."""


@dataclasses.dataclass
class Snapshot:
    """Host-memory copy of everything a checkpoint holds, taken at a step boundary."""

    step: int
    cursor: int
    tensors: dict[str, dict[str, torch.Tensor]]
    """Blob name -> flat tensor dict (one safetensors blob each)."""
    documents: dict[str, Any]
    """Blob name -> JSON-able document (one JSON blob each)."""
    config_hash: str
    world: dict[str, Any] = dataclasses.field(default_factory=dict)
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The evaluation of this step (step, loss, tokens), for the manifest; {}: not evaluated."""
    sharded: dict[str, Any] | None = None
    """A DCP state dict (nested dicts of DTensors/tensors, host copies: :func:`elastic_ft.checkpoint.sharded.stage`)
    saved through :mod:`elastic_ft.checkpoint.sharded` instead of ``tensors`` (then ``{}``); None: a replicated snapshot."""


def snapshot(step: int, cursor: int, tensors: dict[str, dict[str, torch.Tensor]], **fields) -> Snapshot:
    """Copy ``tensors`` to contiguous CPU memory (detached, so training may mutate the originals)."""
    return Snapshot(step=step, cursor=cursor, tensors=host_copies(tensors), **fields)


def host_copies(tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Private contiguous host copies of ``tensors`` (same groups and names), taken while training waits.

    Host tensors are cloned one by one: ``clone()`` is ~1.5x faster than
    ``to("cpu", copy=True)`` for the hundreds of small LoRA tensors a snapshot
    copies. Device tensors all go into one buffer per save (:func:`staged_copy`):
    one allocation, copies queued without waiting, one wait at the end, instead
    of one blocking ``.to("cpu")`` (a stream sync) per tensor. Cost: one pass over
    the trainable state; the waits no longer grow with the number of tensors.
    """
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in tensors}
    on_device: list[tuple[str, str, torch.Tensor]] = []
    for name, group in tensors.items():
        for key, t in group.items():
            if t.device.type == "cpu":
                out[name][key] = t.detach().clone(memory_format=torch.contiguous_format)
            else:
                on_device.append((name, key, t.detach()))
    if on_device:
        # Pinned (page-locked) host memory is what lets a device-to-host copy run without blocking; CUDA has it.
        pin = all(t.device.type == "cuda" for _, _, t in on_device)
        for (name, key, _), copy in zip(on_device, staged_copy([t for _, _, t in on_device], pin=pin)):
            out[name][key] = copy
    return {name: {key: out[name][key] for key in group} for name, group in tensors.items()}  # the given order


STAGING_ALIGN = 64
"""Byte alignment of each tensor in a staging buffer: any dtype's element size divides it (a slice is then
viewable as that dtype), and it is a cache line."""


def staging_layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """The byte offset of each of ``tensors`` in one staging buffer, each aligned to :data:`STAGING_ALIGN`
    and none overlapping, and the buffer's size in bytes."""
    offsets, size = [], 0
    for t in tensors:
        size += -size % STAGING_ALIGN
        offsets.append(size)
        size += t.numel() * t.element_size()
    return offsets, size


def staged_copy(tensors: list[torch.Tensor], *, pin: bool) -> list[torch.Tensor]:
    """Host copies of ``tensors`` as views into one new buffer (laid out by :func:`staging_layout`).

    ``pin``: the buffer is page-locked and each copy queued with ``non_blocking=True``
    on its device's current stream (after the step's work, so it reads the final
    values); then one wait per device for all of them. The views are valid only
    after that wait, which this function does before returning. Without ``pin``
    each copy completes in turn (for host tensors: the buffer logic alone).
    """
    offsets, size = staging_layout(tensors)
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    copies = []
    for t, offset in zip(tensors, offsets):
        view = buffer[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=pin)
        copies.append(view)
    if pin:
        for device in {t.device for t in tensors}:
            torch.cuda.current_stream(device).synchronize()  # the one host sync of the save's copy
    return copies


def new_writer_token() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def new_nonce() -> str:
    """Makes a save's blob keys fresh, so a retried or concurrent save never overwrites one."""
    return uuid.uuid4().hex[:8]


def shard_tensors(tensors: dict[str, dict[str, torch.Tensor]], parts: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Each group's tensors dealt into ``parts`` shards of about equal bytes.

    Greedy largest-first into the lightest shard, ties broken by name: the same
    input gives the same shards in every process.
    """
    out = {}
    for group, named in tensors.items():
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(parts)]
        load = [0] * parts
        for name, t in sorted(named.items(), key=lambda kv: (-kv[1].numel() * kv[1].element_size(), kv[0])):
            i = min(range(parts), key=lambda j: (load[j], j))
            shards[i][name] = t
            load[i] += t.numel() * t.element_size()
        out[group] = shards
    return out


class CheckpointWriter:
    """Uploads snapshots and commits manifests for one run."""

    def __init__(self, store: ObjectStore, run_id: str, *, writer_token: str | None = None) -> None:
        self.store = store
        self.run_id = run_id
        self.writer_token = writer_token or new_writer_token()

    def commit(self, snap: Snapshot) -> Manifest:
        """Upload every blob of ``snap`` from this process, then commit its manifest.

        Raises :class:`CheckpointConflict` if another writer holds this step, and
        the store's errors for anything else.
        """
        nonce = new_nonce()
        blobs = self.upload_part(snap, nonce, part=0, parts=1)
        return self.commit_manifest(snap, blobs)

    def upload_part(self, snap: Snapshot, nonce: str, *, part: int, parts: int) -> dict[str, BlobRef]:
        """Upload this process's share of ``snap``: tensor shard ``part`` of ``parts``.

        Replicas hold identical state, so the shares are a pure function of the
        tensors (byte-balanced by name), not of who uploads them; part 0 also
        carries the JSON documents. All parts together are the checkpoint.
        """
        prefix = f"{BLOB_PREFIX}{snap.step:012d}-{nonce}/"
        jobs: list[tuple[str, str, Callable[[], Data]]] = []  # (blob name, key, serialise)
        for group, shards in shard_tensors(snap.tensors, parts).items():
            if shards[part]:
                name = group if parts == 1 else f"{group}/{part:05d}-of-{parts:05d}"
                key = prefix + name.replace("/", "-") + ".safetensors"
                jobs.append((name, key, functools.partial(safetensors_segments, shards[part])))
        if part == 0:
            for name, doc in snap.documents.items():
                jobs.append((name, prefix + f"{name}.json", functools.partial(json_bytes, doc)))
        # Serialising costs no copy (the blobs are views of the snapshot), so the
        # blobs go up side by side: small ones each in a thread of this pool,
        # large ones' parts through the store's own pool.
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, max(1, len(jobs))), thread_name_prefix="ckpt-blob") as pool:
            futures = {name: pool.submit(lambda k=key, make=make: self.put_blob(k, make())) for name, key, make in jobs}
            return {name: f.result() for name, f in futures.items()}

    def commit_manifest(self, snap: Snapshot, blobs: dict[str, BlobRef]) -> Manifest:
        """Write the manifest naming ``blobs`` (all uploaded): the checkpoint now exists."""
        manifest = Manifest(
            run_id=self.run_id, step=snap.step, cursor=snap.cursor, created=time.time(),
            writer=self.writer_token, config_hash=snap.config_hash, blobs=dict(sorted(blobs.items())),
            world=snap.world, rng=snap.rng, scheduler=snap.scheduler, batch_plan=snap.batch_plan, eval=snap.eval,
        )
        self._commit_manifest(manifest)
        return manifest

    def put_blob(self, key: str, data: Data) -> BlobRef:
        def ref(digest: str) -> BlobRef:
            return BlobRef(key=key, size=len(data), sha256=digest, chunk_size=CHUNK_SIZE)

        if len(data) < _HASH_IN_THREAD_BYTES:
            self.store.put(key, data)
            return ref(blob_sha256(data, CHUNK_SIZE))
        # Hash while the bytes go up (hashlib releases the GIL): the digest then
        # costs no wall time on top of the upload.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as hasher:
            digest = hasher.submit(blob_sha256, data, CHUNK_SIZE)
            self.store.put(key, data)
            return ref(digest.result())

    def _commit_manifest(self, manifest: Manifest) -> None:
        key = manifest_key(manifest.step)
        try:
            self.store.put(key, manifest.to_json(), if_absent=True)
        except ObjectExists:
            # A 412 after a retried PUT may be our own first attempt that landed
            # but whose reply was lost: only the writer token can tell.
            existing = parse_manifest(self.store.get(key), key=key)
            if existing.writer == self.writer_token:
                log.info("manifest %s was already committed by this writer (retried PUT); keeping it", key)
                return
            raise CheckpointConflict(
                f"step {manifest.step} of run {self.run_id!r} was already committed by writer "
                f"{existing.writer!r} ({self.store.join(key)}); two jobs are writing the same run: "
                f"give each job its own run_id"
            ) from None


_HASH_IN_THREAD_BYTES = 1 << 20


def json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


QUARANTINE_PREFIX = "quarantine/"


def retire(store: ObjectStore, manifest_key_: str, reason: str) -> str:
    """Move a manifest that failed verification out of ``manifests/`` into ``quarantine/``.

    Resume has rolled the run back past it, so the step will be trained and
    committed again; its old manifest would block that commit (one key per step
    is what makes racing writers conflict). The copy keeps it for inspection,
    with the reason; its blobs become orphans that gc collects after the grace.
    A manifest that is not valid JSON (torn, too deep) is kept as text instead;
    one over the size cap is not even read (it could be any size): only its
    size is kept.
    """
    name = manifest_key_.rsplit("/", 1)[-1]
    target = f"{QUARANTINE_PREFIX}{name.removesuffix('.json')}-{uuid.uuid4().hex[:8]}.json"
    record: dict[str, Any] = {"retired": time.time(), "reason": reason}
    listed = [o.size for o in store.list(manifest_key_) if o.key == manifest_key_]
    if listed and listed[0] > MAX_MANIFEST_BYTES:
        record["manifest_size"] = listed[0]
    else:
        data = store.get(manifest_key_)
        try:
            if len(data) > MAX_MANIFEST_BYTES or json_depth_exceeds(data, MAX_MANIFEST_DEPTH):
                raise ValueError("not parsed: too large or too deep")
            record["manifest"] = json.loads(bytes(data))
        except ValueError:
            record["manifest_text"] = bytes(data[:MAX_MANIFEST_BYTES]).decode("utf-8", "replace")
    store.put(target, json.dumps(record, indent=1).encode(), if_absent=True)
    store.delete(manifest_key_)
    return target
