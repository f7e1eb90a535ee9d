"""Where a download's bytes land: reading a GET body into a slice of one buffer, that buffer, or a file.

A download of ``n`` bytes into memory costs one copy of them: every ranged GET
reads its body straight from the socket into its slice of one anonymous
mapping of the object's size (:class:`Buffer`), hashing each whole digest
chunk as soon as it is in, while it is in this core's cache. A download into
a file (:class:`FileSink`) reads each range into its worker's own buffer of
one range and writes it at its offset: memory is one range per worker,
whatever the object's size.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import mmap
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from elastic_ft.checkpoint.digest import BlobDigest

# Piece size of reads through botocore's public body: as s3transfer reads
# (part-sized temporaries would cost fresh pages).
_READ_SIZE = 256 * 1024

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def read_into(body: Any, into: memoryview, digest: BlobDigest | None = None, offset: int = 0) -> int:
    """Read a GET body into ``into``; returns the byte count (short if truncated).

    A plain urllib3 response is read from the socket straight into ``into``
    (:func:`_socket_reader`); anything else through botocore's public
    ``readinto`` in pieces. Each whole chunk of ``digest`` (``into`` holding
    the blob from ``offset``) is hashed as soon as it is in.
    """
    direct = _socket_reader(body)
    read = direct[0] if direct is not None else body.readinto
    chunk = digest.chunk_size if digest is not None else len(into)
    got = hashed = 0
    while got < len(into):
        end = min(hashed + chunk, len(into))
        n = read(into[got : end if direct is not None else min(end, got + _READ_SIZE)])
        if not n:
            break
        got += n
        if digest is not None and got == end:
            digest.update(offset + hashed, into[hashed:got])
            hashed = got
    if direct is not None:
        direct[1]()
    return got


def _socket_reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[], None]] | None:
    """``(readinto, release)`` reading ``body`` straight from its ``http.client`` response, or None.

    The one place that reads private attributes: botocore's
    ``StreamingBody._raw_stream`` (the urllib3 response) and urllib3's
    ``HTTPResponse._fp`` (the ``http.client`` response). Why: with urllib3
    1.26 (what botocore pins here) every public read path copies each byte
    twice more than this one: ``StreamingBody.readinto`` calls urllib3's
    ``readinto``, which reads a temporary ``bytes`` of the size asked
    (``http.client`` allocates and fills it) and copies it into the target.
    Measured here (a verified 1 GiB get from SeaweedFS on 2 cores, 7 runs
    alternating): 1.15 s this way, 1.36 s through ``readinto`` in 256 KiB
    pieces, 1.24 s in 1 MiB pieces. Used only for a body that is not
    content-encoded (then the socket's bytes are the object's); ``release``
    hands the connection back to urllib3's pool once the body is read to its
    end, as urllib3 does when it reads the end itself. None, and the public
    path, for any other body (another HTTP stack, an attribute renamed).
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or raw.headers.get("content-encoding"):
        return None

    def release() -> None:
        if fp.isclosed():
            raw.release_conn()

    return fp.readinto, release


def total_size(resp: dict, got: int) -> int:
    """The whole object's size from a (possibly ranged) GET response; ``got`` for a 200 answer."""
    match = _CONTENT_RANGE.match(str(resp.get("ContentRange") or ""))
    if match and match.group(3) != "*":
        return int(match.group(3))
    return got  # a 200 answer to a ranged GET: the server sent the whole object


class Landing:
    """What the parallel ranges of one download write into; ready once the first answer's size is checked.

    The first range's worker asks for its slice (:meth:`slice`) only after the
    answer's Content-Range total has matched the expected size; the other
    ranges are sent only then (:meth:`wait_allocated`), so a wrong size costs
    one request and no allocation. :meth:`landed` is called by the worker
    once its range is whole.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._allocated = threading.Event()

    def slice(self, start: int, stop: int) -> memoryview:
        raise NotImplementedError

    def landed(self, start: int, stop: int) -> None:
        """Bytes ``start..stop`` were read into their slice (by this thread)."""

    def wait_allocated(self, first: concurrent.futures.Future) -> None:
        """Wait until the first slice was taken, or ``first`` (the request that takes it) failed: raise its error."""
        first.add_done_callback(lambda _f: self._allocated.set())
        self._allocated.wait()
        if not self._ready():
            first.result()  # raises what stopped it
            raise AssertionError("the first range completed without taking its slice")

    def _ready(self) -> bool:
        raise NotImplementedError


class Buffer(Landing):
    """A download's buffer, allocated by the first request that needs it.

    When ``size`` is a manifest's claim, the first range's worker asks for its
    slice only after the answer's Content-Range total has matched that size:
    a corrupt manifest (10**15 bytes) costs a BlobMismatch, not an allocation.
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._view: memoryview | None = None

    @property
    def view(self) -> memoryview:
        assert self._view is not None, "the buffer is allocated by the first slice taken"
        return self._view

    def slice(self, start: int, stop: int) -> memoryview:
        with self._lock:
            if self._view is None:
                self._view = anonymous_buffer(self.size)
                self._allocated.set()
        return self._view[start:stop]

    def _ready(self) -> bool:
        return self._view is not None


class FileSink(Landing):
    """A download into the open file ``fd``: each range read into its worker thread's own buffer of
    ``range_size`` bytes, then written at its offset (``pwrite``); a retried range reuses the buffer.

    Memory: one ``range_size`` buffer per worker thread that took part,
    released with the sink. The file is never mapped: a full disk is an
    ``OSError`` of one write, not a SIGBUS. No in-order :attr:`view`: a digest
    of a file download must be a chunked one, fed in the workers.
    """

    def __init__(self, fd: int, size: int, range_size: int) -> None:
        super().__init__(size)
        self.fd, self.range_size = fd, range_size
        self._buffers: dict[int, memoryview] = {}

    def _mine(self) -> memoryview:
        me = threading.get_ident()
        with self._lock:
            buf = self._buffers.get(me)
            if buf is None:
                buf = self._buffers[me] = anonymous_buffer(self.range_size)
            self._allocated.set()
        return buf

    def slice(self, start: int, stop: int) -> memoryview:
        assert stop - start <= self.range_size, "a range larger than the sink's buffers"
        return self._mine()[: stop - start]

    def landed(self, start: int, stop: int) -> None:
        data = self._mine()[: stop - start]
        while data:
            written = os.pwrite(self.fd, data, start)
            data, start = data[written:], start + written

    def _ready(self) -> bool:
        return self._allocated.is_set() and bool(self._buffers)


def anonymous_buffer(size: int) -> memoryview:
    """A writable buffer for a download, not zero-filled up front.

    An anonymous mapping: the kernel supplies each page as a ranged GET first
    writes it, where ``bytearray(size)`` first zeroes the whole buffer in one
    thread (0.5 s per GB here, before the first byte arrives). Private, not
    Python's default shared mapping: shared anonymous memory is shmem, whose
    page faults cost twice as much CPU (perf: a 1 GB load spent half its time
    in shmem_get_folio_gfp).
    """
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


__all__ = ["Buffer", "FileSink", "Landing", "anonymous_buffer", "read_into", "total_size"]
