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
Those checks are :mod:`elastic_ft.checkpoint.safetensors_header` (no torch);
this module adds the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

# The header's format and checks live apart, torch-free, so that verifying a checkpoint needs no torch;
# re-exported here, where the tensors are.
from elastic_ft.checkpoint.safetensors_header import (  # noqa: F401
    MAX_HEADER_BYTES, Entry, HeaderCorrupt, decode_header, encode_header,
)
from elastic_ft.checkpoint.segments import Segments


def _dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {
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

# --------------------------------------------------------------------------- writing


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
    if not writable or any((base + e.start) % e.itemsize for e in entries):
        try:
            return load_safetensors(bytes(data))
        except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            where = f"blob {key!r}" if key else "safetensors blob"
            raise HeaderCorrupt(f"{where} could not be parsed by safetensors: {exc}") from exc
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = _torch_dtype(e, key)
        count = (e.end - e.start) // e.itemsize
        if count == 0:
            out[e.name] = torch.empty(e.shape, dtype=dtype)  # frombuffer refuses an empty view
        else:
            out[e.name] = torch.frombuffer(data, dtype=dtype, count=count, offset=base + e.start).view(e.shape)
    return out


def _torch_dtype(e: Entry, key: str | None) -> torch.dtype:
    """The torch dtype of a checked entry; :class:`HeaderCorrupt` where this torch lacks it (as for an unknown name)."""
    dtype = DTYPES.get(e.dtype)
    if dtype is None:
        where = f"blob {key!r}" if key else "safetensors blob"
        raise HeaderCorrupt(f"{where}: safetensors header entry {e.name!r} has unknown dtype {e.dtype!r} "
                            f"(known: {', '.join(DTYPES)})")
    return dtype
