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

The checks are plain JSON and arithmetic, so :func:`verify_metadata` (what
``ckpt verify`` and a resume's probe run) needs no torch; only building DCP's
``Metadata`` (:func:`decode_metadata`, :func:`encode_metadata`) imports it,
which keeps torch's import (~3.5 s of CPU) out of the read-only CLI commands.
Cost: one JSON parse and one pass over the chunks (~150 bytes each).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any

from elastic_ft.checkpoint.errors import BlobMismatch
from elastic_ft.checkpoint.manifest import BlobRef, json_depth_exceeds
from elastic_ft.checkpoint.safetensors_header import ITEMSIZES

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

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
    # Imported here: only a sharded save, which already holds torch, encodes (see the module's docstring).
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from elastic_ft.checkpoint.codec import DTYPES

    names = {dtype: name for name, dtype in DTYPES.items()}
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
        tensors[fqn] = {"dtype": names[entry.properties.dtype], "size": list(entry.size), "chunks": chunks}
    planner = {fqn: list(path) for fqn, path in sorted((md.planner_data or {}).items())}
    doc = {"format": FORMAT, "version": md.version, "tensors": tensors, "planner_data": planner}
    return json.dumps(doc, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- decoding


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of the document, checked: its dtype's name, size, and chunks as (offsets, sizes, where)."""

    dtype: str
    size: list[int]
    chunks: list[tuple[list[int], list[int], Stored]]


@dataclasses.dataclass(frozen=True)
class _Parsed:
    version: str | None
    tensors: dict[str, _Tensor]
    planner: dict[str, tuple]


def _parse(data: bytes | memoryview, *, key: str) -> _Parsed:
    """The document of blob ``key``, every field checked, without torch; :class:`MetadataCorrupt` otherwise."""
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
    entries = {fqn: _tensor(where, fqn, info) for fqn, info in tensors.items()}
    return _Parsed(version, entries, _planner(where, planner, entries))


def decode_metadata(data: bytes | memoryview, *, key: str) -> Metadata:
    """The DCP ``Metadata`` of blob ``key``, every field checked; :class:`MetadataCorrupt` naming ``key`` otherwise."""
    parsed = _parse(data, key=key)
    # Imported here: only a load into tensors builds DCP's objects (see the module's docstring).
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    from elastic_ft.checkpoint.codec import DTYPES

    entries, storage = {}, {}
    for fqn, t in parsed.tensors.items():
        dtype = DTYPES.get(t.dtype)
        if dtype is None:  # a name the checks know but this torch does not
            raise MetadataCorrupt(f"sharded checkpoint metadata {key!r}: tensor {fqn!r} has unknown dtype "
                                  f"{t.dtype!r} (known: {', '.join(DTYPES)})")
        chunks = []
        for offsets, sizes, stored in t.chunks:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            storage[MetadataIndex(fqn, chunk.offsets)] = stored
            chunks.append(chunk)
        entries[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(t.size),
                                             chunks=chunks)
    return Metadata(state_dict_metadata=entries, planner_data=parsed.planner, storage_data=storage,
                    version=parsed.version)


def verify_metadata(data: bytes | memoryview, blobs: dict[str, BlobRef], *, key: str) -> None:
    """Check blob ``key`` as :func:`decode_metadata` and :func:`check_locations` do, without torch.

    What a verify or a probe needs: the tensors it describes are not loaded there.
    """
    parsed = _parse(data, key=key)
    whole = sum(math.prod(t.size) * ITEMSIZES[t.dtype] for t in parsed.tensors.values())
    _check_stored(whole, ((fqn, s) for fqn, t in parsed.tensors.items() for _, _, s in t.chunks), blobs, key=key)


def _tensor(where: str, fqn: str, info: Any) -> _Tensor:
    def bad(what: str) -> MetadataCorrupt:
        return MetadataCorrupt(f"{where}: tensor {fqn!r} {what}")

    if not isinstance(info, dict) or not isinstance(info.get("chunks"), list):
        raise bad("is not an object with a 'chunks' list")
    dtype = info.get("dtype")
    itemsize = ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise bad(f"has unknown dtype {dtype!r} (known: {', '.join(ITEMSIZES)})")
    size = _ints(info.get("size"))
    if size is None:
        raise bad(f"has size {info.get('size')!r}, not a list of at most {MAX_DIMS} non-negative integers")
    chunks, seen = [], set()
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
        if length != math.prod(sizes) * itemsize:
            raise bad(f"chunk {i} spans {length} bytes but its sizes {sizes} of {dtype} need "
                      f"{math.prod(sizes) * itemsize}")
        if tuple(offsets) in seen:  # DCP indexes a tensor's chunks by their offsets
            raise bad(f"has two chunks at {offsets}")
        seen.add(tuple(offsets))
        chunks.append((offsets, sizes, Stored(blob, offset, length)))
    return _Tensor(dtype, size, chunks)


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
    whole = sum(math.prod(e.size) * e.properties.dtype.itemsize for e in md.state_dict_metadata.values())
    _check_stored(whole, ((index.fqn, loc) for index, loc in (md.storage_data or {}).items()), blobs, key=key)


def _check_stored(whole: int, locations, blobs: dict[str, BlobRef], *, key: str) -> None:
    """:func:`check_locations` on the tensors' total bytes ``whole`` and (fqn, :class:`Stored`) ``locations``."""
    stored = sum(ref.size for name, ref in blobs.items() if name.startswith(SHARDED_PREFIX) and name != METADATA_BLOB)
    if whole > stored:
        raise MetadataCorrupt(f"sharded checkpoint metadata {key!r} describes tensors of {whole:,} bytes in all, "
                              f"more than its blobs hold ({stored:,}); it does not describe this checkpoint")
    for fqn, loc in locations:
        ref = blobs.get(loc.blob)
        if ref is None:
            raise MetadataCorrupt(f"sharded checkpoint metadata {key!r}: tensor {fqn!r} is stored in blob "
                                  f"{loc.blob!r}, which its manifest does not list")
        if loc.offset + loc.length > ref.size:
            raise MetadataCorrupt(f"sharded checkpoint metadata {key!r}: tensor {fqn!r} spans bytes "
                                  f"{loc.offset}..{loc.offset + loc.length} of blob {ref.key!r}, which has {ref.size}")
