"""The safetensors codec: tensor blobs written without a copy, and read back with their header checked.

The format is standard safetensors (an 8-byte little-endian header length, a
JSON header padded with spaces to 8 bytes, then the data), so
``safetensors.torch.load`` reads what the writer produces and the reader reads
what ``safetensors`` writes. One dtype table serves both directions.

The reader does not trust the header: a blob's sha256 only proves it is the
bytes the writer uploaded, not that the writer wrote them right. Every entry is
checked (known dtype, a shape of non-negative ints, offsets inside the data,
entries contiguous from 0 to the end, each ``end - start`` the shape's byte
count) before any tensor is viewed, and every violation, including one
``safetensors`` itself finds, raises :class:`HeaderCorrupt`: a
:class:`BlobMismatch`, so resume counts the checkpoint corrupt and falls back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from elastic_ft.checkpoint.segments import Segments
from elastic_ft.checkpoint.errors import BlobMismatch


def _dtype_table() -> dict[str, torch.dtype]:
    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    # Names safetensors also knows, where this torch has the dtype (uint16.. since torch 2.3).
    for name, attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64"),
                       ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                       ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
        if getattr(torch, attr, None) is not None:
            table[name] = getattr(torch, attr)
    return table


DTYPES: dict[str, torch.dtype] = _dtype_table()
"""safetensors dtype name -> torch dtype: the one table the writer and the reader share."""

# The writer's own layout covers the dtypes it always did; any other dtype goes
# through ``safetensors.save`` as before, so the bytes written stay the same.
_WRITER_NAMES: dict[torch.dtype, str] = {
    DTYPES[name]: name for name in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
}

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""A header claiming more is corrupt (safetensors' own limit)."""


class HeaderCorrupt(BlobMismatch):
    """A safetensors blob whose header is malformed or does not describe its data."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor a header describes: ``start``/``end`` are offsets into the data (after the header)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


# --------------------------------------------------------------------------- writing


def encode_header(header: dict[str, Any]) -> bytes:
    """The length prefix and JSON header, padded with spaces to a multiple of 8 (as safetensors pads)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


def safetensors_segments(tensors: dict[str, torch.Tensor]) -> Segments:
    """``tensors`` in the safetensors format, as a header plus each tensor's own memory.

    Costs no copy of the data: the store writes or uploads straight from the
    tensors (a snapshot's private copies), so a commit costs no serialising
    pass over the state. Dtypes outside the writer's table, and tensors not on
    the CPU, go through ``safetensors``.
    """
    if any(t.dtype not in _WRITER_NAMES or t.device.type != "cpu" for t in tensors.values()):
        return Segments([save_safetensors(tensors)])
    header: dict[str, Any] = {}
    data = []
    offset = 0
    # Widest dtype first (as safetensors orders them): every tensor's data then
    # starts at a multiple of its element size, so a reader can view it in place.
    for name in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        t = tensors[name].detach().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _WRITER_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        if n:
            data.append(t.reshape(-1).view(torch.uint8).numpy())  # a view: keeps the tensor alive
        offset += n
    return Segments([encode_header(header), *data])


# --------------------------------------------------------------------------- reading


def decode_header(data: bytes | bytearray | memoryview, *, key: str | None = None) -> tuple[int, list[Entry]]:
    """The offset where the data starts, and the header's entries in data order, all checked.

    Raises :class:`HeaderCorrupt` naming the blob ``key`` (when given) and the
    entry for: a blob shorter than 8 bytes, a header length past the blob or
    over :data:`MAX_HEADER_BYTES`, a header that is not a JSON object, a
    ``__metadata__`` that is not str -> str, an unknown dtype, a shape that is
    not a list of non-negative ints, offsets that are not ``[start, end]`` ints
    inside the data, entries that leave a gap or overlap (safetensors requires
    them contiguous from 0 to the data's end), or a byte count that does not
    match dtype and shape. An empty header (no tensors) over no data is valid.
    """
    where = f"blob {key!r}" if key else "safetensors blob"
    if len(data) < 8:
        raise HeaderCorrupt(f"{where} has {len(data)} bytes, fewer than the 8 of a safetensors header length")
    head_len = int.from_bytes(data[:8], "little")
    if head_len > min(len(data) - 8, MAX_HEADER_BYTES):
        raise HeaderCorrupt(f"{where} declares a {head_len}-byte safetensors header but holds {len(data) - 8} bytes "
                            f"after the length (at most {MAX_HEADER_BYTES} allowed)")
    try:
        header = json.loads(bytes(data[8 : 8 + head_len]))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HeaderCorrupt(f"{where}: its safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderCorrupt(f"{where}: its safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderCorrupt(f"{where}: the safetensors header's __metadata__ is not an object of strings")
    base = 8 + head_len
    entries = sorted((_entry(where, name, info) for name, info in header.items()), key=lambda e: (e.start, e.end))
    _check_layout(where, entries, len(data) - base)
    return base, entries


def _entry(where: str, name: str, info: Any) -> Entry:
    """One header entry, checked on its own (not yet against the others or the data's length)."""
    def bad(what: str) -> HeaderCorrupt:
        return HeaderCorrupt(f"{where}: safetensors header entry {name!r} {what}")

    if not isinstance(info, dict):
        raise bad(f"is a JSON {type(info).__name__}, not an object")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise bad(f"has unknown dtype {info.get('dtype')!r} (known: {', '.join(DTYPES)})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise bad(f"has data_offsets {offsets!r}, not [start, end] integers")
    start, end = offsets
    if not 0 <= start <= end:
        raise bad(f"has data_offsets [{start}, {end}]: start must be >= 0 and <= end")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - start != nbytes:
        raise bad(f"spans {end - start} bytes but its shape {shape} of {info['dtype']} needs {nbytes}")
    return Entry(name, dtype, tuple(shape), start, end)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layout(where: str, entries: list[Entry], data_len: int) -> None:
    """Entries (sorted by start) tile the data exactly: no gap, no overlap, nothing past its end."""
    offset = 0
    for e in entries:
        if e.end > data_len:
            raise HeaderCorrupt(f"{where}: safetensors header entry {e.name!r} has data_offsets [{e.start}, {e.end}] "
                                f"past the end of the data ({data_len} bytes)")
        if e.start != offset:
            what = "overlaps the entry before it" if e.start < offset else "leaves a gap before it"
            raise HeaderCorrupt(f"{where}: safetensors header entry {e.name!r} starts at {e.start} and {what} "
                                f"(which ends at {offset})")
        offset = e.end
    if offset != data_len:
        raise HeaderCorrupt(f"{where}: the safetensors header describes {offset} bytes of data but the blob holds "
                            f"{data_len}")


def tensors_from_safetensors(data: bytes | bytearray | memoryview, *, key: str | None = None,
                             ) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob; raises :class:`HeaderCorrupt` naming ``key`` for a malformed one.

    A writable buffer (a ``bytearray``, or the ``memoryview`` the S3 store
    returns for a large download) is not copied again: each tensor is a view of
    it (``torch.frombuffer``), so a loaded checkpoint needs its size in memory
    once, not twice. Anything else, or an offset not aligned to its dtype, goes
    through ``safetensors``, which copies; its errors become :class:`HeaderCorrupt` too.
    """
    base, entries = decode_header(data, key=key)
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    if not writable or any((base + e.start) % e.dtype.itemsize for e in entries):
        try:
            return load_safetensors(bytes(data))
        except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            where = f"blob {key!r}" if key else "safetensors blob"
            raise HeaderCorrupt(f"{where} could not be parsed by safetensors: {exc}") from exc
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        count = (e.end - e.start) // e.dtype.itemsize
        if count == 0:
            out[e.name] = torch.empty(e.shape, dtype=e.dtype)  # frombuffer refuses an empty view
        else:
            out[e.name] = torch.frombuffer(data, dtype=e.dtype, count=count, offset=base + e.start).view(e.shape)
    return out
