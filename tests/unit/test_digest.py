"""Blob digests (elastic_ft.checkpoint.digest): sha256 over chunks, fed in any order."""

from __future__ import annotations

import hashlib
import random
import threading

import pytest

from elastic_ft.checkpoint.digest import BlobDigest, blob_sha256, chunk_count
from elastic_ft.checkpoint.segments import Segments

DATA = random.Random(7).randbytes(10_000)


def hash_list(data: bytes, chunk: int) -> str:
    """The definition, spelled out with hashlib alone."""
    return hashlib.sha256(b"".join(hashlib.sha256(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))).hexdigest()


@pytest.mark.parametrize("chunk", [0, 10_000, 20_000])
def test_one_chunk_or_unchunked_is_the_plain_sha256(chunk):
    assert chunk_count(len(DATA), chunk) == 1
    assert blob_sha256(DATA, chunk) == hashlib.sha256(DATA).hexdigest()


@pytest.mark.parametrize("chunk", [1, 1000, 3333, 9_999])
def test_larger_blobs_hash_the_list_of_chunk_digests(chunk):
    assert chunk_count(len(DATA), chunk) == -(-len(DATA) // chunk)
    want = hash_list(DATA, chunk)
    assert want != hashlib.sha256(DATA).hexdigest()
    assert blob_sha256(DATA, chunk) == want
    assert blob_sha256(DATA, chunk, threads=3) == want
    cuts = [0, 1, 999, 1000, 1001, 5000, len(DATA)]  # buffers that split chunks anywhere
    assert blob_sha256(Segments([DATA[a:b] for a, b in zip(cuts, cuts[1:])]), chunk) == want


def test_any_changed_byte_changes_the_digest():
    good = blob_sha256(DATA, 1000)
    for i in (0, 999, 1000, 5555, len(DATA) - 1):
        bad = bytearray(DATA)
        bad[i] ^= 1
        assert blob_sha256(bad, 1000) != good, i
    assert blob_sha256(DATA[:-1], 1000) != good
    assert blob_sha256(DATA[1000:] + DATA[:1000], 1000) != good  # the same chunks in another order


def test_chunked_digest_takes_whole_chunk_pieces_in_any_order_from_any_thread():
    digest = BlobDigest(len(DATA), 1000)
    assert digest.any_order and digest.piece_size(2500) == 3000 and digest.piece_size(1) == 1000
    offsets = list(range(0, len(DATA), 3000))
    random.Random(1).shuffle(offsets)
    threads = [threading.Thread(target=digest.update, args=(o, memoryview(DATA)[o : o + 3000])) for o in offsets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert digest.hexdigest() == hash_list(DATA, 1000)


def test_chunked_digest_refuses_split_chunks_and_missing_ones():
    digest = BlobDigest(len(DATA), 1000)
    with pytest.raises(ValueError, match="whole chunks"):
        digest.update(500, DATA[500:1500])
    with pytest.raises(ValueError, match="whole chunks"):
        digest.update(0, DATA[:1500])
    digest.update(9000, DATA[9000:])  # the last chunk ends the blob
    with pytest.raises(ValueError, match="9 of 10 chunks were not hashed"):
        digest.hexdigest()


def test_plain_digest_takes_pieces_in_order_only():
    digest = BlobDigest(len(DATA), 0)
    assert not digest.any_order and digest.piece_size(2500) == 2500
    digest.update(0, DATA[:4000])
    with pytest.raises(ValueError, match="in order"):
        digest.update(8000, DATA[8000:])
    with pytest.raises(ValueError, match="4000 of 10000 bytes"):
        digest.hexdigest()
    digest.update(4000, DATA[4000:])
    assert digest.hexdigest() == hashlib.sha256(DATA).hexdigest()


@pytest.mark.parametrize(("chunk", "threads"), [(0, 1), (20_000, 1), (1000, 1), (1000, 4), (3333, 3)])
def test_a_file_range_hashes_as_the_same_bytes_in_memory(tmp_path, chunk, threads):
    from elastic_ft.checkpoint.digest import file_blob_sha256

    path = tmp_path / "f"
    path.write_bytes(b"head" + DATA + b"tail")  # the blob at an offset, with bytes after it
    expected = hash_list(DATA, chunk) if chunk_count(len(DATA), chunk) > 1 else hashlib.sha256(DATA).hexdigest()
    with open(path, "rb") as f:
        assert file_blob_sha256(f.fileno(), 4, len(DATA), chunk, threads=threads) == expected


@pytest.mark.parametrize("chunk", [0, 1000])
def test_a_file_shorter_than_the_blob_is_an_error_not_a_digest(tmp_path, chunk):
    from elastic_ft.checkpoint.digest import file_blob_sha256

    path = tmp_path / "f"
    path.write_bytes(DATA[:-1])
    with open(path, "rb") as f, pytest.raises(ValueError, match="ends at"):
        file_blob_sha256(f.fileno(), 0, len(DATA), chunk, threads=2)
