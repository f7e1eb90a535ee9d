"""The DCP storage layer of sharded checkpoints: a ``StorageWriter`` and a ``StorageReader`` over the ObjectStore.

``torch.distributed.checkpoint`` plans who writes and reads which chunk;
these classes put the bytes on the store and get them back
(:mod:`elastic_ft.checkpoint.sharded` drives them and holds the layout's
rationale). Both follow the contract of torch's own ``FileSystemWriter``/
``FileSystemReader``, without their pickles: ``BYTE_IO`` items (non-tensor
leaves, which DCP would ``torch.save``) are refused, and the metadata is our
JSON (:mod:`elastic_ft.checkpoint.dcp_metadata`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import uuid
import warnings
from typing import Any

import tenacity
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from elastic_ft.checkpoint.dcp_metadata import METADATA_BLOB, SHARDED_PREFIX, MetadataCorrupt, Stored, encode_metadata
from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.manifest import BLOB_PREFIX, BlobRef, Manifest
from elastic_ft.checkpoint.reader import fetch_verified
from elastic_ft.checkpoint.segments import Segments
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointWriter, json_bytes

log = logging.getLogger(__name__)

_ALIGN = 64  # each chunk starts on a multiple of any dtype's size (a view of it needs no realignment)


class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` putting each rank's chunks in one blob of the save's prefix.

    After ``dcp.save`` returns, :attr:`blobs` on the coordinator holds every
    blob of the checkpoint (all ranks', the documents', the metadata's); the
    manifest is the caller's to commit.
    """

    def __init__(self, writer: CheckpointWriter, step: int, nonce: str, documents: dict[str, Any], *,
                 attempts: int = 1, abandoned: threading.Event | None = None) -> None:
        super().__init__()
        self.writer, self.documents, self.attempts = writer, documents, attempts
        # Set when the save is given up (the run ends on an error): no put starts, a backoff ends at once.
        self.abandoned = abandoned or threading.Event()
        self.prefix = f"{BLOB_PREFIX}{step:012d}-{nonce}/"
        self.is_coordinator = False
        self.blobs: dict[str, BlobRef] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.blobs = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        raw = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if raw:
            raise ValueError(f"sharded checkpoint: {', '.join(raw[:3])} are not tensors; DCP would pickle them: "
                             f"put non-tensor state in Snapshot.documents")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # DTensor shards go in this rank's data blob; whole tensors (replicated
        # state such as each parameter's optimizer ``step``, which DCP deals to
        # one rank each) in a small blob of their own: every rank reads them all
        # at load, and must not have to fetch every rank's data blob to do so.
        token = uuid.uuid4().hex[:12]
        results: list[WriteResult] = []
        for kind, items in (("data", [i for i in plan.items if i.type == WriteItemType.SHARD]),
                            ("whole", [i for i in plan.items if i.type != WriteItemType.SHARD])):
            if items:
                results += self._write_blob(f"{kind}-{token}", items, planner)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_blob(self, name: str, items: list, planner: SavePlanner) -> list[WriteResult]:
        """``items`` back to back (each on a multiple of ``_ALIGN``) as blob ``sharded/<name>``."""
        buffers: list[Any] = []
        placed = []  # (write item, offset, length)
        offset = 0
        for item in items:
            t = planner.resolve_data(item).detach()
            t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
            n = t.numel() * t.element_size()
            pad = -offset % _ALIGN
            if pad:
                buffers.append(bytes(pad))
                offset += pad
            if n:
                buffers.append(t.reshape(-1).view(torch.uint8).numpy())  # a view: no copy of the snapshot
            placed.append((item, offset, n))
            offset += n
        ref = self._put(self.prefix + f"sharded-{name}.bin", Segments(buffers))
        return [WriteResult(index=item.index, size_in_bytes=n, storage_data=Stored(SHARDED_PREFIX + name, off, n, ref))
                for item, off, n in placed]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        blobs: dict[str, BlobRef] = {}
        storage: dict[MetadataIndex, Stored] = {}
        for rank_results in results:
            for wr in rank_results:
                loc: Stored = wr.storage_data
                blobs[loc.blob] = loc.ref
                storage[wr.index] = dataclasses.replace(loc, ref=None)
        metadata.storage_data = storage
        for name, doc in sorted(self.documents.items()):
            blobs[name] = self._put(self.prefix + f"{name}.json", json_bytes(doc))
        blobs[METADATA_BLOB] = self._put(self.prefix + "sharded-metadata.json", encode_metadata(metadata))
        self.blobs = blobs

    def _put(self, key: str, data: Any) -> BlobRef:
        # One blob's put is this rank's own business (no collective inside), so it
        # is safe to retry here; the save as a whole is collective and is not.
        def attempt() -> BlobRef:
            if self.abandoned.is_set():
                raise RuntimeError(f"put of {key} not started: the save was abandoned, as the run ends on an error")
            return self.writer.put_blob(key, data)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max(1, self.attempts)),
            wait=tenacity.wait_exponential(multiplier=0.5, max=8), sleep=self.abandoned.wait,
            retry=tenacity.retry_if_exception_type(StoreError), reraise=True,
            before_sleep=lambda rs: log.warning("sharded checkpoint: put of %s failed (attempt %d: %s); retrying",
                                                key, rs.attempt_number, rs.outcome.exception()),
        )
        return retrying(attempt)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen by DCP from a path: always passed in explicitly


class StoreReader(StorageReader):
    """A DCP ``StorageReader`` over the blobs a committed manifest lists (``metadata``: read already)."""

    def __init__(self, store: ObjectStore, manifest: Manifest, metadata: Metadata) -> None:
        super().__init__()
        self.store, self.manifest, self.metadata = store, manifest, metadata
        self.storage: dict[MetadataIndex, Stored] = metadata.storage_data
        self.chunks: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {
            MetadataIndex(fqn, c.offsets): (entry.properties.dtype, c.sizes)
            for fqn, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)
            for c in entry.chunks
        }

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_blob: dict[str, list] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise MetadataCorrupt(f"sharded checkpoint at step {self.manifest.step}: {req.storage_index.fqn!r} "
                                      f"is not a tensor, and non-tensor state is never unpickled")
            per_blob.setdefault(self.storage[req.storage_index].blob, []).append(req)
        # Each blob is fetched once and verified whole; the next one downloads
        # while this one is copied out, and at most two are held at a time.
        names = sorted(per_blob)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-shard") as pool:
            fetch = lambda name: pool.submit(fetch_verified, self.store, self.manifest.blobs[name])  # noqa: E731
            pending = fetch(names[0]) if names else None
            try:
                for i, name in enumerate(names):
                    data = pending.result()
                    pending = fetch(names[i + 1]) if i + 1 < len(names) else None
                    with warnings.catch_warnings():  # a read-only buffer is only read from here
                        warnings.filterwarnings("ignore", message="The given buffer is not writable")
                        for req in per_blob[name]:
                            self._copy(data, req, planner)
                    del data
            finally:
                if pending is not None:
                    pending.cancel()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _copy(self, data: Any, req: Any, planner: LoadPlanner) -> None:
        loc = self.storage[req.storage_index]
        dtype, sizes = self.chunks[req.storage_index]
        if loc.length:
            src = torch.frombuffer(data, dtype=dtype, count=loc.length // dtype.itemsize, offset=loc.offset)
        else:
            src = torch.empty(0, dtype=dtype)
        src = _region(src.view(sizes), req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise MetadataCorrupt(f"sharded checkpoint at step {self.manifest.step}: {req.storage_index.fqn!r} "
                                  f"read as {list(src.size())} where {list(target.size())} was requested")
        target.copy_(src)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def _region(chunk: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The view of ``chunk`` a load request reads: ``lengths[d]`` elements from ``offsets[d]`` in each dim."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        chunk = chunk.narrow(dim, offset, length)
    return chunk
