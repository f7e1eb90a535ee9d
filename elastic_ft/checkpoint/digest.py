"""Blob digests: sha256 over fixed-size chunks, so one blob can be hashed in parallel.

The digest a manifest records for a blob (``BlobRef.sha256``, with its
``chunk_size``):

- a blob of one chunk or less (``size <= chunk_size``), or a digest asked
  for with ``chunk_size == 0`` (whole): the plain sha256 of its bytes, what
  ``sha256sum`` prints;
- a larger blob: the sha256 of the concatenated 32-byte sha256 digests of its
  consecutive ``chunk_size`` chunks (the last one may be shorter). A one-level
  hash list, like S3's composite checksums: every byte is still covered.

Why chunks: sha256 is sequential, so a plain digest of a large blob is one
thread's work (about a CPU-second per GB on the 2-core reference machine),
and a download had to hash its parts in order behind the transfer. Chunk
digests are independent: each S3 download worker hashes each chunk of its
range as it lands, while the bytes are in that core's cache and other ranges
are in flight.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Iterable

from elastic_ft.checkpoint.segments import Data, as_segments

CHUNK_SIZE = 1 << 20
"""What the writer records. 1 MiB divides any download part size of whole MiB,
so the S3 store's ranged GETs start and end on chunk boundaries."""


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunk digests a blob of ``size`` bytes has; 1 means a plain sha256."""
    if chunk_size <= 0 or size <= chunk_size:
        return 1
    return -(-size // chunk_size)


def _sha256(buffers: Iterable[memoryview | bytes]) -> bytes:
    """The sha256 digest of the buffers in order (``.hex()`` of it is the hexdigest)."""
    h = hashlib.sha256()
    for buf in buffers:
        h.update(buf)  # hashlib releases the GIL for large buffers
    return h.digest()


def _compose(chunk_digests: Iterable[bytes]) -> str:
    return hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def blob_sha256(data: Data, chunk_size: int, *, threads: int = 1) -> str:
    """The digest of ``data`` with chunks of ``chunk_size`` (see the module doc).

    With ``threads`` > 1 the chunks are hashed that many at a time.
    """
    segments = as_segments(data)
    if chunk_count(len(segments), chunk_size) == 1:
        return _sha256(segments.buffers).hex()
    offsets = range(0, len(segments), chunk_size)

    def chunk(offset: int) -> bytes:
        return _sha256(segments.views(offset, chunk_size))

    if threads <= 1:
        return _compose(map(chunk, offsets))
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-hash") as pool:
        return _compose(pool.map(chunk, offsets))


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that hash one file with :func:`file_blob_sha256` (its chunks are independent)."""


def file_blob_sha256(fd: int, offset: int, size: int, chunk_size: int, *, threads: int = 1) -> str:
    """The digest (as :func:`blob_sha256`) of the ``size`` bytes of the open file ``fd`` from ``offset``.

    Read with ``pread`` a chunk at a time and each chunk hashed by the thread
    that read it (``threads`` at a time for a chunked digest; a plain one is
    one thread's, in order): memory is one chunk per thread, whatever the
    size. :class:`ValueError` if the file ends before ``offset + size``.
    """
    digest = BlobDigest(size, chunk_size)
    piece = chunk_size if digest.any_order else CHUNK_SIZE

    def read(start: int) -> bytes:
        data = os.pread(fd, min(piece, size - start), offset + start)
        if len(data) != min(piece, size - start):
            raise ValueError(f"the file ends at {offset + start + len(data)}, before byte {offset + size}")
        return data

    if not digest.any_order:
        for start in range(0, size, piece):
            digest.update(start, read(start))
        return digest.hexdigest()

    def chunk(start: int) -> None:
        digest.update(start, read(start))  # each chunk's own entry: safe from any thread

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="file-hash") as pool:
        for _ in pool.map(chunk, range(0, size, piece)):
            pass  # futures only (no data) are queued: the results are None
    return digest.hexdigest()


class BlobDigest:
    """The digest of a ``size``-byte blob, fed with its pieces as they download.

    Chunked (``any_order``): pieces may come in any order and from any thread,
    each starting on a chunk boundary and holding whole chunks (the last may
    end at the blob's end); each is hashed at once. Plain: pieces must come in
    order, from one thread at a time.
    """

    def __init__(self, size: int, chunk_size: int) -> None:
        self.size = size
        self.chunk_size = chunk_size
        self._count = chunk_count(size, chunk_size)
        self.any_order = self._count > 1
        # Filled as chunks land, not allocated up front: ``size`` comes from a
        # manifest, and a corrupt one (10**15 bytes) must not cost memory
        # before the store has checked it against the object's real size.
        self._chunks: dict[int, bytes] = {}
        self._plain = hashlib.sha256()
        self._next = 0

    def piece_size(self, preferred: int) -> int:
        """``preferred`` rounded up to whole chunks: the ranges to fetch so that no chunk is split."""
        if not self.any_order:
            return preferred
        return -(-preferred // self.chunk_size) * self.chunk_size

    def update(self, offset: int, piece: memoryview | bytes) -> None:
        """Hash ``piece``, the blob's bytes from ``offset``."""
        if not self.any_order:
            if offset != self._next:
                raise ValueError(f"a plain digest takes its pieces in order: got offset {offset}, expected {self._next}")
            self._plain.update(piece)
            self._next += len(piece)
            return
        size = self.chunk_size
        if offset % size or (len(piece) % size and offset + len(piece) != self.size):
            raise ValueError(f"piece {offset}+{len(piece)} does not hold whole chunks of {size} bytes")
        for start in range(0, len(piece), size):
            self._chunks[(offset + start) // size] = _sha256([piece[start : start + size]])

    def hexdigest(self) -> str:
        if not self.any_order:
            if self._next != self.size:
                raise ValueError(f"only {self._next} of {self.size} bytes were hashed")
            return self._plain.hexdigest()
        missing = self._count - len(self._chunks)
        if missing:
            raise ValueError(f"{missing} of {self._count} chunks were not hashed")
        return _compose(self._chunks[i] for i in range(self._count))
