"""The safetensors blobs the writer produces and the reader parses without a second copy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from elastic_ft.checkpoint.codec import HeaderCorrupt, tensors_from_safetensors
from elastic_ft.checkpoint.store import BlobMismatch
from elastic_ft.checkpoint.digest import blob_sha256
from elastic_ft.checkpoint.segments import Segments
from elastic_ft.checkpoint.writer import safetensors_segments

TENSORS = {
    "w": torch.randn(5, 3),
    "half": torch.ones(3, dtype=torch.bfloat16),  # odd byte count before wider dtypes would misalign them
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(3.0, dtype=torch.float64),
    "steps": torch.arange(7),
    "mask": torch.tensor([True, False, True]),
    "bytes": torch.arange(5, dtype=torch.uint8),
    "strided": torch.randn(4, 6).t(),  # not contiguous
}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


def safetensors_bytes(tensors):
    return safetensors_segments(tensors).tobytes()


def test_writer_blobs_are_standard_safetensors():
    assert_same(load_safetensors(safetensors_bytes(TENSORS)), TENSORS)


def test_writer_blobs_are_views_of_the_tensors_not_a_serialised_copy():
    w = torch.zeros(1000)
    segments = safetensors_segments({"w": w})
    w += 1  # a snapshot's tensors are private; this only proves the bytes are not copied
    assert_same(load_safetensors(segments.tobytes()), {"w": torch.ones(1000)})


def test_segments_read_any_range_across_buffer_boundaries():
    buffers = [b"ab", bytearray(b"cdef"), memoryview(b"g"), b"", b"hijkl"]
    segments = Segments(buffers)
    whole = b"abcdefghijkl"
    assert len(segments) == len(whole) and segments.tobytes() == whole
    for offset in range(len(whole) + 1):
        for size in range(len(whole) + 2 - offset):
            assert segments.read(offset, size) == whole[offset : offset + size], (offset, size)
            assert b"".join(segments.views(offset, size)) == whole[offset : offset + size], (offset, size)
    for chunk in (0, 1, 3, 5):
        assert blob_sha256(segments, chunk) == blob_sha256(whole, chunk)


def _safetensors_save(tensors):
    return save_safetensors({k: t.contiguous() for k, t in tensors.items()})  # it refuses strided input


def _writable_view(data):
    return memoryview(bytearray(data))  # what the S3 store returns for a large download


@pytest.mark.parametrize("make", [bytearray, bytes, _writable_view], ids=["bytearray", "bytes", "memoryview"])
@pytest.mark.parametrize("writer", [safetensors_bytes, _safetensors_save], ids=["ours", "safetensors"])
def test_reader_parses_blobs_of_either_writer(writer, make):
    assert_same(tensors_from_safetensors(make(writer(TENSORS))), TENSORS)


@pytest.mark.parametrize("make", [bytearray, _writable_view], ids=["bytearray", "memoryview"])
def test_reader_views_a_writable_buffer_in_place_and_tensors_stay_writable(make):
    buf = make(safetensors_bytes({"w": torch.zeros(4), "m": torch.zeros(2, dtype=torch.float16)}))
    loaded = tensors_from_safetensors(buf)
    loaded["w"] += 1  # an optimizer updates loaded state in place
    assert torch.equal(tensors_from_safetensors(buf)["w"], torch.ones(4)), "not a view of the downloaded buffer"


def test_corrupt_header_is_an_error_not_garbage():
    buf = bytearray(safetensors_bytes({"w": torch.zeros(4)}))
    buf[8:12] = b"\xff\xff\xff\xff"
    with pytest.raises(Exception):
        tensors_from_safetensors(buf)


# --------------------------------------------------------------------------- malformed headers


def _blob(header, data: bytes = b"", *, head_len: int | None = None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # aligned, so a writable buffer takes the zero-copy path
    return (len(head) if head_len is None else head_len).to_bytes(8, "little") + head + data


def _f32(shape, start, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, end]}


MALFORMED = {
    "offset past end": (_blob({"w": _f32([4], 0, 16)}, bytes(8)), "'w'"),
    "overlapping": (_blob({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12)), "'b'"),
    "gap": (_blob({"a": _f32([1], 0, 4), "b": _f32([1], 8, 12)}, bytes(12)), "'b'"),
    "trailing data": (_blob({"a": _f32([1], 0, 4)}, bytes(8)), "describes 4 bytes"),
    "wrong size for shape": (_blob({"w": _f32([3], 0, 16)}, bytes(16)), "'w'"),
    "unknown dtype": (_blob({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "'X9'"),
    "negative shape": (_blob({"w": _f32([-1, -4], 0, 16)}, bytes(16)), "'w'"),
    "bool in shape": (_blob({"w": _f32([True], 0, 4)}, bytes(4)), "'w'"),
    "offsets not ints": (_blob({"w": _f32([1], 0.0, 4)}, bytes(4)), "'w'"),
    "entry not an object": (_blob({"w": [1, 2]}, bytes(4)), "'w'"),
    "header length past the blob": (_blob({"w": _f32([1], 0, 4)}, bytes(4), head_len=1000), "1000-byte"),
    "header length huge": (_blob(b"{}", head_len=2**63), "header"),
    "too short": (b"\x00\x00", "fewer than the 8"),
    "not JSON": (_blob(b"{nope", bytes(3)), "not valid JSON"),
    "not UTF-8": (_blob(b'{"\xff":1}'), "not valid JSON"),
    "deeply nested": (_blob(b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
    "not an object": (_blob([1, 2]), "not an object"),
    "metadata not strings": (_blob({"__metadata__": {"k": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("make", [bytearray, bytes, _writable_view], ids=["bytearray", "bytes", "memoryview"])
@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_header_raises_header_corrupt_naming_blob_and_entry(case, make):
    blob, names = MALFORMED[case]
    with pytest.raises(HeaderCorrupt) as err:
        tensors_from_safetensors(make(blob), key="blobs/000000000002-ab/model.safetensors")
    assert isinstance(err.value, BlobMismatch), "resume would not count the checkpoint corrupt"
    message = str(err.value)
    assert "blobs/000000000002-ab/model.safetensors" in message and names in message, message


def test_safetensors_own_parse_error_becomes_header_corrupt():
    # A header this codec accepts but safetensors refuses: the copying path's error is wrapped too.
    blob = _blob({"__metadata__": {"k": "v"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4],
                                                    "extra": 1}}, bytes(4))
    try:
        load_safetensors(blob)
    except Exception:
        with pytest.raises(HeaderCorrupt, match="could not be parsed by safetensors"):
            tensors_from_safetensors(blob, key="k")
    else:
        assert tensors_from_safetensors(blob, key="k")["w"].tolist() == [0.0]


def test_empty_header_over_no_data_is_valid():
    assert tensors_from_safetensors(bytearray(safetensors_bytes({}))) == {}
    assert tensors_from_safetensors(_blob({"__metadata__": {"format": "pt"}}, b"")) == {}


def test_writer_bytes_are_unchanged():
    # The format is pinned: the header bytes of a known input, as the writer has always produced them.
    blob = safetensors_bytes({"b": torch.zeros(2, dtype=torch.int8), "a": torch.ones(1)})
    head = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"I8","shape":[2],"data_offsets":[4,6]}}'
    head += b" " * (-len(head) % 8)
    assert blob == len(head).to_bytes(8, "little") + head + torch.ones(1).numpy().tobytes() + bytes(2)


def test_the_torch_free_header_table_agrees_with_torchs_dtypes():
    """``ckpt verify`` checks headers with safetensors_header's item sizes (no torch); a load views the
    tensors with codec's torch dtypes. Every name torch has must have torch's item size there."""
    from elastic_ft.checkpoint.codec import DTYPES
    from elastic_ft.checkpoint.safetensors_header import ITEMSIZES

    assert set(DTYPES) <= set(ITEMSIZES)
    assert {name: ITEMSIZES[name] for name in DTYPES} == {name: dtype.itemsize for name, dtype in DTYPES.items()}
