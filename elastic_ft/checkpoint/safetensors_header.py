"""The safetensors header, without torch: its dtype names, its encoding, and its checked decoding.

A checkpoint's header is JSON and its checks are arithmetic (dtype names and
their item sizes, shapes, offsets), so verifying a checkpoint (``ckpt verify``,
a resume's probe) needs no tensor library; :mod:`elastic_ft.checkpoint.codec`
turns the checked entries into tensors and imports torch for it. Keeping this
apart keeps torch's import (~3.5 s of CPU) out of the read-only CLI commands.

The format: an 8-byte little-endian header length, a JSON header padded with
spaces to 8 bytes, then the data. Costs one JSON parse of the header and one
pass over its entries, whatever the data's size.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from elastic_ft.checkpoint.errors import BlobMismatch

ITEMSIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}
"""safetensors dtype name -> bytes per element: the names the checkpoint reader knows (codec's
``DTYPES`` maps each to torch's dtype, where this torch has it)."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""A header claiming more is corrupt (safetensors' own limit)."""


class HeaderCorrupt(BlobMismatch):
    """A safetensors blob whose header is malformed or does not describe its data."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor a header describes: ``dtype`` its safetensors name, ``itemsize`` its bytes per element,
    ``start``/``end`` offsets into the data (after the header)."""

    name: str
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    start: int
    end: int


def encode_header(header: dict[str, Any]) -> bytes:
    """The length prefix and JSON header, padded with spaces to a multiple of 8 (as safetensors pads)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


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
    dtype = info.get("dtype")
    itemsize = ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise bad(f"has unknown dtype {dtype!r} (known: {', '.join(ITEMSIZES)})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise bad(f"has data_offsets {offsets!r}, not [start, end] integers")
    start, end = offsets
    if not 0 <= start <= end:
        raise bad(f"has data_offsets [{start}, {end}]: start must be >= 0 and <= end")
    nbytes = math.prod(shape) * itemsize
    if end - start != nbytes:
        raise bad(f"spans {end - start} bytes but its shape {shape} of {info['dtype']} needs {nbytes}")
    return Entry(name, dtype, itemsize, tuple(shape), start, end)


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
