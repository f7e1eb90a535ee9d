"""Loading checkpoints: list committed manifests, verify every blob, fall back.

Only manifests count: blobs without one are invisible. The newest manifest
whose blobs all verify (size and sha256) is loaded; a missing or altered blob
makes the load fall back to the previous manifest, and each skip is reported
with its reason. A foreign manifest (another run, another format version) is
not skipped silently: it raises, because it means the URI points somewhere
wrong, and guessing could resume the wrong model.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from elastic_ft.checkpoint.manifest import MANIFEST_PREFIX, BlobRef, Manifest, parse_manifest, step_of_key
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore, StoreError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedCheckpoint:
    manifest: Manifest
    tensors: dict[str, dict[str, torch.Tensor]]
    documents: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Skipped:
    step: int
    key: str
    reason: str


def list_manifests(store: ObjectStore) -> list[ObjectInfo]:
    """Committed manifest objects, oldest step first."""
    found = [o for o in store.list(MANIFEST_PREFIX) if step_of_key(o.key) is not None]
    return sorted(found, key=lambda o: step_of_key(o.key))


def read_manifest(store: ObjectStore, key: str, *, run_id: str | None = None) -> Manifest:
    return parse_manifest(store.get(key), key=key, expected_run_id=run_id)


_IN_FLIGHT = 2


def _get_verified(store: ObjectStore, ref: BlobRef) -> bytes | memoryview:
    return store.get_verified(ref.key, size=ref.size, sha256=ref.sha256, chunk_size=ref.chunk_size)


def load_blobs(store: ObjectStore, manifest: Manifest) -> LoadedCheckpoint:
    """Fetch and verify every blob of ``manifest``; raises :class:`StoreError` naming the first bad one."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    documents: dict[str, Any] = {}
    refs = iter(sorted(manifest.blobs.items()))
    # Two blobs in flight: the next downloads (its parts in parallel, in the
    # store) while this one is parsed. More did not load faster (1 GB on
    # SeaweedFS, bench/checkpoint.py): the parts already fill the store's pool.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_IN_FLIGHT, thread_name_prefix="ckpt-load") as pool:
        pending: collections.deque = collections.deque()

        def fetch_next() -> None:
            item = next(refs, None)
            if item is not None:
                ref = item[1]
                pending.append((item, pool.submit(_get_verified, store, ref)))

        for _ in range(_IN_FLIGHT):
            fetch_next()
        try:
            while pending:
                (name, ref), fetch = pending.popleft()
                data = fetch.result()
                group = name.split("/", 1)[0]  # "model/00001-of-00004": one shard of group "model"
                if ref.key.endswith(".safetensors"):
                    tensors.setdefault(group, {}).update(tensors_from_safetensors(data))
                else:
                    documents[group] = json.loads(bytes(data))
                del data
                fetch_next()
        except BaseException:
            for _, f in pending:
                f.cancel()
            raise
    return LoadedCheckpoint(manifest, tensors, documents)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def tensors_from_safetensors(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob.

    A writable buffer (a ``bytearray``, or the ``memoryview`` the S3 store
    returns for a large download) is not copied again: each tensor is a view of
    it (``torch.frombuffer``), so a loaded checkpoint needs its size in memory
    once, not twice. Anything else, or a layout this does not handle (another
    dtype, an unaligned offset), goes through ``safetensors``, which copies.
    """
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    if not writable or len(data) < 8:
        return load_safetensors(bytes(data))
    head_len = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(bytes(data[8 : 8 + head_len]))
    except ValueError:
        return load_safetensors(bytes(data))
    base = 8 + head_len
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        start, end = info["data_offsets"]
        if dtype is None or (base + start) % dtype.itemsize or end > len(data) - base:
            return load_safetensors(bytes(data))
        count = (end - start) // dtype.itemsize
        if count == 0:
            out[name] = torch.empty(info["shape"], dtype=dtype)
        else:
            out[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=base + start).view(info["shape"])
    return out


def verify(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Re-hash every blob; the list of problems (empty when all verify)."""
    problems = []
    for name, ref in sorted(manifest.blobs.items()):
        try:
            _get_verified(store, ref)
        except StoreError as exc:
            problems.append(f"{name}: {exc}")
    return problems


def load_newest(store: ObjectStore, run_id: str, *, max_step: int | None = None) -> tuple[LoadedCheckpoint | None, list[Skipped]]:
    """The newest committed checkpoint whose blobs verify, and what was skipped on the way.

    ``max_step`` restricts the choice (export of a given step). Raises
    :class:`~elastic_ft.checkpoint.manifest.ManifestError` for a foreign manifest.
    """
    skipped: list[Skipped] = []
    for info in reversed(list_manifests(store)):
        step = step_of_key(info.key)
        assert step is not None
        if max_step is not None and step > max_step:
            continue
        manifest = read_manifest(store, info.key, run_id=run_id)
        try:
            return load_blobs(store, manifest), skipped
        except StoreError as exc:
            reason = f"checkpoint at step {step} is unusable and was skipped: {exc}"
            log.warning(reason)
            skipped.append(Skipped(step, info.key, str(exc)))
    return None, skipped
