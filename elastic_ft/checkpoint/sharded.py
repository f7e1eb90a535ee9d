"""Sharded checkpoints: FSDP2 (DTensor) state through torch.distributed.checkpoint onto the ObjectStore.

DCP's planners decide who writes which chunk at save and who reads which
bytes at load (resharding to any world size); this module is the storage
underneath, on the same commit protocol as every other checkpoint:

- save (:func:`save_sharded`, every rank): each rank writes its DTensor
  chunks as ONE blob, back to back, under the save's fresh
  ``blobs/<step>-<nonce>/`` prefix, named ``sharded/data-<token>`` in the
  manifest (a random token: nothing is keyed by rank), and the whole
  (replicated) tensors DCP dealt it, if any, as a small ``sharded/whole-<token>``.
  The coordinator (group rank 0, the leader) then writes the JSON documents and the DCP metadata as a JSON blob (``sharded/metadata``,
  :mod:`elastic_ft.checkpoint.dcp_metadata`), and the caller commits the
  manifest naming every blob's size and sha256, last, as today.
- load (:func:`load_sharded`): each rank fetches only the blobs it reads
  from, each once, verifies its size and sha256 in full, and copies the
  requested ranges into its tensors.

The storage classes DCP calls are in :mod:`elastic_ft.checkpoint.dcp_storage`,
the metadata's JSON codec in :mod:`elastic_ft.checkpoint.dcp_metadata`.

Never pickle: DCP would ``torch.save`` any non-tensor leaf and ``torch.load``
it back, so those are refused (they belong in ``Snapshot.documents``), and
the metadata is our own JSON, not DCP's pickled ``.metadata``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from elastic_ft.checkpoint.dcp_metadata import METADATA_BLOB, SHARDED_PREFIX, check_locations, decode_metadata
from elastic_ft.checkpoint.dcp_storage import StoreReader, StoreWriter
from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.manifest import BlobRef, Manifest, ManifestCorrupt, ManifestError
from elastic_ft.checkpoint.reader import fetch_verified
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointWriter, Snapshot


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


def save_sharded(writer: CheckpointWriter, snap: Snapshot, nonce: str, group: "dist.ProcessGroup | None",
                 *, attempts: int = 1, abandoned: threading.Event | None = None) -> dict[str, BlobRef]:
    """Save ``snap.sharded`` (and ``snap.documents``) with DCP; collective over ``group``, called on every rank.

    Returns every blob of the checkpoint on the coordinator (group rank 0) and
    ``{}`` elsewhere; the caller commits the manifest. A failure on any rank
    raises :class:`ShardedCheckpointError` on every rank alike (DCP gathers
    each step's errors), naming each rank's failure. Once ``abandoned`` is set, no blob put starts and a
    retry's backoff ends: the save fails (the saver sets it when the run ends on an error).
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
    storage = StoreWriter(writer, snap.step, nonce, snap.documents, attempts=attempts, abandoned=abandoned)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(snap.sharded, storage_writer=storage, process_group=group)
    except CheckpointException as exc:
        raise ShardedCheckpointError(f"sharded save of step {snap.step} failed: {describe(exc)}") from _first(exc)
    return storage.blobs if storage.is_coordinator else {}


def read_metadata(store: ObjectStore, manifest: Manifest) -> Metadata:
    """The verified, decoded DCP metadata of a sharded manifest, every chunk checked to lie in a listed blob."""
    ref = manifest.blobs.get(METADATA_BLOB)
    if ref is None:
        raise ManifestCorrupt(f"manifest {manifest.key!r} has no {METADATA_BLOB!r} blob: not a sharded checkpoint")
    md = decode_metadata(fetch_verified(store, ref), key=ref.key)
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
