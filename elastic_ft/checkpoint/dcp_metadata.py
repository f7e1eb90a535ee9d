"""The JSON codec of a sharded checkpoint's DCP metadata (never pickle).

``torch.distributed.checkpoint`` describes a checkpoint with a ``Metadata``
object (each tensor's dtype, global size and saved chunks, plus where each
chunk's bytes are) that its own file storage pickles. Here it is one JSON
document, written and read by this module only::

    {"format": "elastic_ft.dcp-metadata/1", "version": "<DCP's>",
     "tensors": {"<fqn>": {"dtype": "F32", "size": [8, 4],
                           "chunks": [{"offsets": [0, 0], "sizes": [4, 4],
                                       "blob": "sharded/data-<token>", "offset": 0, "length": 64}]}},
     "planner_data": {"<fqn>": ["model", "<name>"]}}

``blob`` is the chunk's blob *name* in the manifest (which gives its key,
size and sha256), so a load needs no rank numbers: ranks are dealt anew at
every restart. Only tensors are described: DCP would store any other leaf
with ``torch.save`` and read it back with ``torch.load``.

The decoder trusts nothing: size and nesting depth are checked before
parsing, and every field after (a known dtype, sizes and offsets that are
non-negative ints of one rank, each chunk inside its tensor, each byte count
matching its chunk). Anything else is :class:`MetadataCorrupt`, a
:class:`BlobMismatch`, so resume counts the checkpoint corrupt and falls back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

from elastic_ft.checkpoint.codec import DTYPES
from elastic_ft.checkpoint.errors import BlobMismatch
from elastic_ft.checkpoint.manifest import BlobRef, json_depth_exceeds

FORMAT = "elastic_ft.dcp-metadata/1"
MAX_METADATA_BYTES = 64 << 20
"""Ours hold ~150 bytes per chunk: 64 MiB is ~400k chunks (an 8B model's params and
optimizer state at a world of 400+). Anything larger is refused unread."""
MAX_DEPTH = 8
"""Ours nest 6 deep (document, tensors, tensor, chunks, chunk, offsets)."""
MAX_DIMS = 64
SHARDED_PREFIX = "sharded/"
"""Manifest names of a sharded checkpoint's own blobs: its data blobs and its metadata."""
METADATA_BLOB = "sharded/metadata"
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class MetadataCorrupt(BlobMismatch):
    """A sharded checkpoint's metadata blob that is not one of ours or does not describe its data."""


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one saved chunk's bytes are: ``length`` bytes at ``offset`` of blob ``blob`` (its manifest name).

    The ``storage_data`` of a DCP ``WriteResult``; ``ref`` travels only from a
    writing rank to the coordinator (it is not part of the JSON document).
    """

    blob: str
    offset: int
    length: int
    ref: BlobRef | None = None


# --------------------------------------------------------------------------- encoding


def encode_metadata(md: Metadata) -> bytes:
    """``md`` (its ``storage_data`` maps each chunk's MetadataIndex to a :class:`Stored`) as JSON bytes.

    Raises ValueError for a non-tensor entry or a chunk without a location: a
    bug of the writer, since non-tensor leaves are refused before saving.
    """
    storage: dict[MetadataIndex, Stored] = md.storage_data or {}
    tensors: dict[str, Any] = {}
    for fqn, entry in sorted(md.state_dict_metadata.items()):
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"sharded checkpoint entry {fqn!r} is not a tensor ({type(entry).__name__})")
        chunks = []
        for chunk in entry.chunks:
            loc = storage.get(MetadataIndex(fqn, chunk.offsets))
            if loc is None:
                raise ValueError(f"sharded checkpoint entry {fqn!r} chunk at {list(chunk.offsets)} was not written")
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "blob": loc.blob,
                           "offset": loc.offset, "length": loc.length})
        tensors[fqn] = {"dtype": _NAMES[entry.properties.dtype], "size": list(entry.size), "chunks": chunks}
    planner = {fqn: list(path) for fqn, path in sorted((md.planner_data or {}).items())}
    doc = {"format": FORMAT, "version": md.version, "tensors": tensors, "planner_data": planner}
    return json.dumps(doc, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- decoding


def decode_metadata(data: bytes | memoryview, *, key: str) -> Metadata:
    """The DCP ``Metadata`` of blob ``key``, every field checked; :class:`MetadataCorrupt` naming ``key`` otherwise."""
    where = f"sharded checkpoint metadata {key!r}"
    if len(data) > MAX_METADATA_BYTES:
        raise MetadataCorrupt(f"{where} has {len(data):,} bytes, more than the {MAX_METADATA_BYTES:,} allowed; "
                              f"it is not an elastic_ft sharded checkpoint's metadata")
    if json_depth_exceeds(data, MAX_DEPTH):
        raise MetadataCorrupt(f"{where} nests deeper than {MAX_DEPTH} levels; it is not an elastic_ft "
                              f"sharded checkpoint's metadata")
    try:
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MetadataCorrupt(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise MetadataCorrupt(f"{where} has format {got!r}, not {FORMAT!r}: it was not written by elastic_ft "
                              f"(a torch FileSystemWriter's pickled .metadata is never read)")
    version, tensors, planner = doc.get("version"), doc.get("tensors"), doc.get("planner_data", {})
    if version is not None and not isinstance(version, str):
        raise MetadataCorrupt(f"{where}: 'version' is {version!r}, not a string")
    if not isinstance(tensors, dict) or not isinstance(planner, dict):
        raise MetadataCorrupt(f"{where}: 'tensors' and 'planner_data' must be JSON objects")
    entries, storage = {}, {}
    for fqn, info in tensors.items():
        entries[fqn] = _tensor(where, fqn, info, storage)
    return Metadata(state_dict_metadata=entries, planner_data=_planner(where, planner, entries),
                    storage_data=storage, version=version)


def _tensor(where: str, fqn: str, info: Any, storage: dict[MetadataIndex, Stored]) -> TensorStorageMetadata:
    def bad(what: str) -> MetadataCorrupt:
        return MetadataCorrupt(f"{where}: tensor {fqn!r} {what}")

    if not isinstance(info, dict) or not isinstance(info.get("chunks"), list):
        raise bad("is not an object with a 'chunks' list")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise bad(f"has unknown dtype {info.get('dtype')!r} (known: {', '.join(DTYPES)})")
    size = _ints(info.get("size"))
    if size is None:
        raise bad(f"has size {info.get('size')!r}, not a list of at most {MAX_DIMS} non-negative integers")
    chunks = []
    for i, c in enumerate(info["chunks"]):
        if not isinstance(c, dict):
            raise bad(f"chunk {i} is not an object")
        offsets, sizes = _ints(c.get("offsets")), _ints(c.get("sizes"))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            raise bad(f"chunk {i} needs 'offsets' and 'sizes' of {len(size)} non-negative integers, "
                      f"got {c.get('offsets')!r} and {c.get('sizes')!r}")
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise bad(f"chunk {i} at {offsets} of sizes {sizes} reaches past the tensor's size {size}")
        blob, offset, length = c.get("blob"), c.get("offset"), c.get("length")
        if not isinstance(blob, str) or not blob.startswith(SHARDED_PREFIX) or not _nonneg(offset) or not _nonneg(length):
            raise bad(f"chunk {i} needs a 'blob' name under 'sharded/' and non-negative 'offset' and 'length'")
        if length != math.prod(sizes) * dtype.itemsize:
            raise bad(f"chunk {i} spans {length} bytes but its sizes {sizes} of {info['dtype']} need "
                      f"{math.prod(sizes) * dtype.itemsize}")
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        index = MetadataIndex(fqn, chunk.offsets)
        if index in storage:
            raise bad(f"has two chunks at {offsets}")
        storage[index] = Stored(blob, offset, length)
        chunks.append(chunk)
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=chunks)


def _planner(where: str, planner: dict, entries: dict) -> dict[str, tuple]:
    out = {}
    for fqn, path in planner.items():
        if fqn not in entries or not isinstance(path, list) or not path or len(path) > MAX_DIMS or not all(
                isinstance(p, str) or _nonneg(p) for p in path):
            raise MetadataCorrupt(f"{where}: planner_data of {fqn!r} is {path!r}, not the path of one of its tensors")
        out[fqn] = tuple(path)
    return out


def _nonneg(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, list) or len(value) > MAX_DIMS or not all(_nonneg(v) for v in value):
        return None
    return value


def check_locations(md: Metadata, blobs: dict[str, BlobRef], *, key: str) -> None:
    """Raise :class:`MetadataCorrupt` unless every chunk lies inside a blob the manifest lists, and the
    tensors, whole, hold no more bytes than the blobs do.

    The second bound is what keeps a load of whole tensors (:func:`~elastic_ft.checkpoint.sharded.
    load_sharded_full`, which allocates each at its stated size) within the checkpoint's own size: the
    chunks DCP saves tile each tensor exactly, so ours always pass it.
    """
    stored = sum(ref.size for name, ref in blobs.items() if name.startswith(SHARDED_PREFIX) and name != METADATA_BLOB)
    whole = sum(math.prod(e.size) * e.properties.dtype.itemsize for e in md.state_dict_metadata.values())
    if whole > stored:
        raise MetadataCorrupt(f"sharded checkpoint metadata {key!r} describes tensors of {whole:,} bytes in all, "
                              f"more than its blobs hold ({stored:,}); it does not describe this checkpoint")
    for index, loc in (md.storage_data or {}).items():
        ref = blobs.get(loc.blob)
        if ref is None:
            raise MetadataCorrupt(f"sharded checkpoint metadata {key!r}: tensor {index.fqn!r} is stored in blob "
                                  f"{loc.blob!r}, which its manifest does not list")
        if loc.offset + loc.length > ref.size:
            raise MetadataCorrupt(f"sharded checkpoint metadata {key!r}: tensor {index.fqn!r} spans bytes "
                                  f"{loc.offset}..{loc.offset + loc.length} of blob {ref.key!r}, which has {ref.size}")
