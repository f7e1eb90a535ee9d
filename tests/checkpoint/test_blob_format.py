"""The safetensors blobs the writer produces and the reader parses without a second copy."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from elastic_ft.checkpoint.reader import tensors_from_safetensors
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
