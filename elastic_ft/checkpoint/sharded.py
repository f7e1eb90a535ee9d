"""Sharded checkpoints: FSDP2 (DTensor) state through torch.distributed.checkpoint onto the ObjectStore.

DCP's planners decide who writes which chunk at save and who reads which
bytes at load (resharding to any world size); this module is the storage
underneath, on the same commit protocol as every other checkpoint:

- save (:func:`save_sharded`, every rank): each rank writes its DTensor
  chunks as ONE blob, back to back, under the save's fresh
  ``blobs/<step>-<nonce>/`` prefix, named ``sharded/data-<token>`` in the
  manifest (a random token: nothing is keyed by rank), and the whole
  (replicated) tensors DCP dealt it, if any, as a small ``sharded/whole-<token>``. The coordinator (group rank 0, the leader) then writes the
  JSON documents and the DCP metadata as a JSON blob (``sharded/metadata``,
  :mod:`elastic_ft.checkpoint.dcp_metadata`), and the caller commits the
  manifest naming every blob's size and sha256, last, as today.
- load (:func:`load_sharded`): each rank fetches only the blobs it reads
  from, each once, verifies its size and sha256 in full, and copies the
  requested ranges into its tensors.

Never pickle: DCP would ``torch.save`` any non-tensor leaf and ``torch.load``
it back, so those are refused (they belong in ``Snapshot.documents``), and
the metadata is our own JSON, not DCP's pickled ``.metadata``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import uuid
import warnings
from typing import Any

import tenacity
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from elastic_ft.checkpoint.dcp_metadata import (
    METADATA_BLOB, SHARDED_PREFIX, MetadataCorrupt, Stored, check_locations, decode_metadata, encode_metadata,
)
from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.manifest import BLOB_PREFIX, BlobRef, Manifest, ManifestCorrupt, ManifestError
from elastic_ft.checkpoint.reader import _get_verified
from elastic_ft.checkpoint.segments import Segments
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot, _json_bytes

log = logging.getLogger(__name__)

_ALIGN = 64  # each chunk starts on a multiple of any dtype's size (a view of it needs no realignment)


class ShardedCheckpointError(RuntimeError):
    """A sharded save or load failed on some rank; the message names each rank's failure."""


def is_sharded(manifest: Manifest) -> bool:
    return METADATA_BLOB in manifest.blobs


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A host-memory copy of a DCP state dict (DTensor placements kept), so training may go on."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager().stage(state)


def non_tensor_leaves(state: dict[str, Any], path: str = "") -> list[str]:
    """Dotted paths of the leaves of ``state`` that are not tensors (DCP would pickle them)."""
    out = []
    for k, v in state.items():
        where = f"{path}.{k}" if path else str(k)
        if isinstance(v, dict):
            out += non_tensor_leaves(v, where)
        elif not isinstance(v, torch.Tensor):
            out.append(f"{where} ({type(v).__name__})")
    return out


def local_shards(state: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """``{top-level key: {dotted name: this rank's local tensor}}``: what this rank holds of ``state``."""
    out: dict[str, dict[str, torch.Tensor]] = {}

    def walk(group: str, node: dict, path: str) -> None:
        for k, v in node.items():
            name = f"{path}.{k}" if path else str(k)
            if isinstance(v, dict):
                walk(group, v, name)
            elif isinstance(v, torch.Tensor):
                out.setdefault(group, {})[name] = v.to_local() if isinstance(v, DTensor) else v

    for group, node in state.items():
        walk(str(group), node if isinstance(node, dict) else {"": node}, "")
    return out


# --------------------------------------------------------------------------- writing


class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` putting each rank's chunks in one blob of the save's prefix.

    After ``dcp.save`` returns, :attr:`blobs` on the coordinator holds every
    blob of the checkpoint (all ranks', the documents', the metadata's); the
    manifest is the caller's to commit.
    """

    def __init__(self, writer: CheckpointWriter, step: int, nonce: str, documents: dict[str, Any], *,
                 attempts: int = 1) -> None:
        super().__init__()
        self.writer, self.documents, self.attempts = writer, documents, attempts
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
            blobs[name] = self._put(self.prefix + f"{name}.json", _json_bytes(doc))
        blobs[METADATA_BLOB] = self._put(self.prefix + "sharded-metadata.json", encode_metadata(metadata))
        self.blobs = blobs

    def _put(self, key: str, data: Any) -> BlobRef:
        # One blob's put is this rank's own business (no collective inside), so it
        # is safe to retry here; the save as a whole is collective and is not.
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max(1, self.attempts)),
            wait=tenacity.wait_exponential(multiplier=0.5, max=8),
            retry=tenacity.retry_if_exception_type(StoreError), reraise=True,
            before_sleep=lambda rs: log.warning("sharded checkpoint: put of %s failed (attempt %d: %s); retrying",
                                                key, rs.attempt_number, rs.outcome.exception()),
        )
        return retrying(self.writer._put_blob, key, data)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen by DCP from a path: always passed in explicitly


def save_sharded(writer: CheckpointWriter, snap: Snapshot, nonce: str, group: "dist.ProcessGroup | None",
                 *, attempts: int = 1) -> dict[str, BlobRef]:
    """Save ``snap.sharded`` (and ``snap.documents``) with DCP; collective over ``group``, called on every rank.

    Returns every blob of the checkpoint on the coordinator (group rank 0) and
    ``{}`` elsewhere; the caller commits the manifest. A failure on any rank
    raises :class:`ShardedCheckpointError` on every rank alike (DCP gathers
    each step's errors), naming each rank's failure.
    """
    if snap.sharded is None:
        raise ValueError(f"snapshot of step {snap.step} holds no sharded state")
    bad = non_tensor_leaves(snap.sharded)
    if bad:
        raise ValueError(f"sharded checkpoint of step {snap.step}: {', '.join(bad[:3])} are not tensors; "
                         f"DCP would pickle them: put non-tensor state in Snapshot.documents")
    clash = [name for name in snap.documents if name == "sharded" or name.startswith(SHARDED_PREFIX)]
    if clash:
        raise ValueError(f"document names {clash} are reserved for sharded state; rename them")
    storage = StoreWriter(writer, snap.step, nonce, snap.documents, attempts=attempts)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(snap.sharded, storage_writer=storage, process_group=group)
    except CheckpointException as exc:
        raise ShardedCheckpointError(f"sharded save of step {snap.step} failed: {describe(exc)}") from _first(exc)
    return storage.blobs if storage.is_coordinator else {}


# --------------------------------------------------------------------------- reading


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
            fetch = lambda name: pool.submit(_get_verified, self.store, self.manifest.blobs[name])  # noqa: E731
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
        src = narrow_tensor_by_index(src.view(sizes), req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise MetadataCorrupt(f"sharded checkpoint at step {self.manifest.step}: {req.storage_index.fqn!r} "
                                  f"read as {list(src.size())} where {list(target.size())} was requested")
        target.copy_(src)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def read_metadata(store: ObjectStore, manifest: Manifest) -> Metadata:
    """The verified, decoded DCP metadata of a sharded manifest, every chunk checked to lie in a listed blob."""
    ref = manifest.blobs.get(METADATA_BLOB)
    if ref is None:
        raise ManifestCorrupt(f"manifest {manifest.key!r} has no {METADATA_BLOB!r} blob: not a sharded checkpoint")
    md = decode_metadata(_get_verified(store, ref), key=ref.key)
    check_locations(md, manifest.blobs, key=ref.key)
    return md


def load_sharded(store: ObjectStore, manifest: Manifest, state: dict[str, Any],
                 group: "dist.ProcessGroup | None" = None) -> None:
    """Load a sharded checkpoint in place into ``state`` (DTensors/tensors of the current world, any size).

    Collective over ``group`` (every rank calls it). Raises the checkpoint
    package's errors (:class:`BlobMismatch`, :class:`ManifestCorrupt`, ...)
    naming the blob, on every rank alike: the first rank's failure is raised
    everywhere (DCP gathers each step's errors).
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    try:
        md, err = read_metadata(store, manifest), None
    except Exception as exc:  # agreed below, so that no rank enters DCP's collectives alone
        md, err = None, exc
    if distributed:
        errors: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, err, group=group)
        err = next((e for e in errors if e is not None), None)
    if err is not None:
        raise err
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=StoreReader(store, manifest, md), process_group=group,
                     no_dist=not distributed)
    except CheckpointException as exc:
        first = _first(exc)
        if isinstance(first, (StoreError, ManifestError)):
            raise first from None
        raise ShardedCheckpointError(f"sharded load of step {manifest.step} failed: {describe(exc)}") from first


def load_sharded_full(store: ObjectStore, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of a sharded checkpoint, whole, by group (``{"model": {...}, "optimizer": {...}}``).

    One process, no collective (export, tests). Names come from the save's
    nesting (DCP's planner data); a flat name ``a.b`` without it is group ``a``.
    """
    md = read_metadata(store, manifest)
    flat = {fqn: torch.empty(e.size, dtype=e.properties.dtype) for fqn, e in md.state_dict_metadata.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=StoreReader(store, manifest, md), no_dist=True)
    except CheckpointException as exc:
        raise _first(exc) from None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, t in flat.items():
        path = md.planner_data.get(fqn) if md.planner_data else None
        group, name = (str(path[0]), ".".join(map(str, path[1:]))) if path and len(path) > 1 else \
            tuple(fqn.split(".", 1)) if "." in fqn else ("", fqn)
        out.setdefault(group, {})[name] = t
    return out


def _first(exc: CheckpointException) -> BaseException:
    """The lowest rank's failure of a DCP step."""
    rank = min(exc.failures)
    return exc.failures[rank][0]


def describe(exc: CheckpointException) -> str:
    """Each failed rank's error on one line: ``rank 1: StoreUnavailable: ...; rank 2: ...``."""
    return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
