"""Saving a checkpoint: snapshot to host memory, upload blobs, commit the manifest.

The commit protocol (DESIGN.md): blobs go to fresh immutable keys under
``blobs/<step>-<nonce>/``; the manifest, naming each blob's size and sha256,
is written last with create-if-absent. Until it lands the checkpoint does not
exist, so a crash at any point leaves at worst orphan blobs for gc.

Saving is split in two so training blocks only for the first half:
:func:`snapshot` copies state to host memory at a step boundary;
:meth:`CheckpointWriter.commit` serialises, uploads and commits, and may run
on a background thread (:class:`AsyncCheckpointer`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

import torch
from safetensors.torch import save as save_safetensors

from elastic_ft.checkpoint.manifest import BLOB_PREFIX, BlobRef, Manifest, manifest_key, parse_manifest
from elastic_ft.checkpoint.store import ObjectExists, ObjectStore, sha256_hex

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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.tensors.values() for t in group.values())


def snapshot(step: int, cursor: int, tensors: dict[str, dict[str, torch.Tensor]], **fields) -> Snapshot:
    """Copy ``tensors`` to contiguous CPU memory (detached, so training may mutate the originals)."""
    copied = {
        name: {k: t.detach().to("cpu", copy=True).contiguous() for k, t in group.items()}
        for name, group in tensors.items()
    }
    return Snapshot(step=step, cursor=cursor, tensors=copied, **fields)


def new_writer_token() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class CheckpointWriter:
    """Uploads snapshots and commits manifests for one run."""

    def __init__(self, store: ObjectStore, run_id: str, *, writer_token: str | None = None) -> None:
        self.store = store
        self.run_id = run_id
        self.writer_token = writer_token or new_writer_token()

    def commit(self, snap: Snapshot, *, before_manifest: Callable[[], None] | None = None) -> Manifest:
        """Upload every blob of ``snap``, then commit its manifest; returns the manifest.

        ``before_manifest`` is a hook between the blobs and the commit (tests use it
        to tear a save). Raises :class:`CheckpointConflict` if another writer holds
        this step, and the store's errors for anything else.
        """
        prefix = f"{BLOB_PREFIX}{snap.step:012d}-{uuid.uuid4().hex[:8]}/"
        blobs: dict[str, BlobRef] = {}
        for name, group in snap.tensors.items():
            blobs[name] = self._put_blob(prefix + f"{name}.safetensors", save_safetensors(group))
        for name, doc in snap.documents.items():
            data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
            blobs[name] = self._put_blob(prefix + f"{name}.json", data)
        if before_manifest is not None:
            before_manifest()
        manifest = Manifest(
            run_id=self.run_id, step=snap.step, cursor=snap.cursor, created=time.time(),
            writer=self.writer_token, config_hash=snap.config_hash, blobs=blobs, world=snap.world,
            rng=snap.rng, scheduler=snap.scheduler, batch_plan=snap.batch_plan,
        )
        self._commit_manifest(manifest)
        return manifest

    def _put_blob(self, key: str, data: bytes) -> BlobRef:
        self.store.put(key, data)
        return BlobRef(key=key, size=len(data), sha256=sha256_hex(data))

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


QUARANTINE_PREFIX = "quarantine/"


def retire(store: ObjectStore, manifest_key_: str, reason: str) -> str:
    """Move a manifest that failed verification out of ``manifests/`` into ``quarantine/``.

    Resume has rolled the run back past it, so the step will be trained and
    committed again; its old manifest would block that commit (one key per step
    is what makes racing writers conflict). The copy keeps it for inspection,
    with the reason; its blobs become orphans that gc collects after the grace.
    """
    data = store.get(manifest_key_)
    name = manifest_key_.rsplit("/", 1)[-1]
    target = f"{QUARANTINE_PREFIX}{name.removesuffix('.json')}-{uuid.uuid4().hex[:8]}.json"
    record = {"retired": time.time(), "reason": reason, "manifest": json.loads(data)}
    store.put(target, json.dumps(record, indent=1).encode(), if_absent=True)
    store.delete(manifest_key_)
    return target


class AsyncCheckpointer:
    """Commits snapshots on one background thread; training blocks only for the snapshot.

    At most one save is in flight: a new :meth:`submit` first waits for the
    previous one. A failed save is logged and reported through ``on_error``
    without killing training; :meth:`flush` waits until the newest save is
    durable and re-raises its failure.
    """

    def __init__(self, writer: CheckpointWriter, *, on_commit: Callable[[Manifest], None] | None = None,
                 on_error: Callable[[Snapshot, BaseException], None] | None = None) -> None:
        self.writer = writer
        self.on_commit = on_commit
        self.on_error = on_error
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, snap: Snapshot) -> None:
        self.wait()
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(snap,), name=f"ckpt-{snap.step}", daemon=True)
        self._thread.start()

    def _run(self, snap: Snapshot) -> None:
        try:
            manifest = self.writer.commit(snap)
        except BaseException as exc:  # reported, never raised on the training thread
            self._error = exc
            log.error("checkpoint of step %d failed: %s", snap.step, exc)
            if self.on_error is not None:
                self.on_error(snap, exc)
            return
        if self.on_commit is not None:
            self.on_commit(manifest)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def flush(self) -> None:
        """Block until the newest save is committed; raise if it failed."""
        self.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
