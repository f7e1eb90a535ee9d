"""Blob bytes held as consecutive buffers, so a blob goes to storage without being joined."""

from __future__ import annotations

import bisect
import itertools
from typing import Iterable, Union


class Segments:
    """Bytes held as consecutive buffers: a blob's header, then each tensor's memory.

    A blob built this way goes to storage without first being joined into one
    buffer (a copy of the whole checkpoint, and as much memory again): a file
    gets each buffer written in turn, an S3 multipart upload gathers each part
    from the buffers it spans, and the digest hashes the buffers in place. The
    buffers must not change until the put returns.
    """

    def __init__(self, buffers: Iterable[bytes | bytearray | memoryview]) -> None:
        self.buffers = [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]
        self._starts = [0, *itertools.accumulate(len(b) for b in self.buffers)]

    def __len__(self) -> int:
        return self._starts[-1]

    def views(self, offset: int, size: int) -> list[memoryview]:
        """Bytes ``offset .. offset + size`` (clipped to the end) as views of the buffers they span."""
        end = min(offset + size, len(self))
        i = bisect.bisect_right(self._starts, offset) - 1
        pieces = []
        while offset < end:
            buf, start = self.buffers[i], self._starts[i]
            take = buf[offset - start : min(end - start, len(buf))]
            pieces.append(take)
            offset += len(take)
            i += 1
        return pieces

    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``offset .. offset + size`` (clipped to the end), gathered in one copy."""
        pieces = self.views(offset, size)
        if len(pieces) == 1 and isinstance(pieces[0].obj, bytes) and len(pieces[0]) == len(pieces[0].obj):
            return pieces[0].obj  # the whole of an immutable buffer: no copy needed
        return b"".join(pieces)

    def tobytes(self) -> bytes:
        return self.read(0, len(self))


Data = Union[bytes, bytearray, memoryview, Segments]
"""What a store's ``put`` takes: one buffer, or :class:`Segments`."""


def as_segments(data: Data) -> Segments:
    return data if isinstance(data, Segments) else Segments([data])
