"""Gets: parallel ranged GETs into one buffer, verified against the manifest while they land.

A download of known size (``get_verified``: the manifest gives it) sends the
first ranged GET and, as soon as its Content-Range total has matched that
size (else :class:`BlobMismatch`, before anything of the claimed size is
allocated), the others, at most ``2 * max_concurrency`` in flight. ``get``
fetches the first ``download_part_size`` bytes, learns the size from
Content-Range and fetches the rest pinned to that ETag (``If-Match``). The
answers must agree on the ETag, so an overwrite during a download restarts it
instead of mixing two versions. The ranges are read straight into one
anonymous mapping of the object's size (:mod:`~elastic_ft.checkpoint.s3.body`),
returned as a writable ``memoryview`` (the reader views tensors in it without
another copy). ``get_verified`` hashes while downloading: a chunked digest
(:mod:`elastic_ft.checkpoint.digest`) in the worker that fetched each range, a
plain one in order as the ranges arrive. An object whose size or digest
differs from the manifest's, as the server consistently answers, is
:class:`BlobMismatch`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from elastic_ft.checkpoint.digest import BlobDigest
from elastic_ft.checkpoint.errors import BlobMismatch, StoreError, StoreUnavailable
from elastic_ft.checkpoint.s3.body import Buffer, FileSink, Landing, read_into, total_size
from elastic_ft.checkpoint.s3.errors import ObjectChanged, TruncatedBody, status
from elastic_ft.checkpoint.s3.target import S3Target

log = logging.getLogger(__name__)

# Whole-download restarts when the object changes under a download.
_RESTARTS = 3


def download(t: S3Target, key: str, *, expect_size: int | None = None, sha256: str | None = None,
             chunk_size: int = 0) -> bytes | memoryview:
    """The object at ``key``; with ``expect_size`` and ``sha256`` (chunked by ``chunk_size``) verified.

    Restarts the whole download if the object changes during it, at most
    :data:`_RESTARTS` times, then :class:`StoreUnavailable` (never a
    :class:`BlobMismatch`: no two answers agreed on what the object is).
    """
    s3key = t.s3key(key)
    for attempt in range(1, _RESTARTS + 1):
        digest = BlobDigest(expect_size, chunk_size) if sha256 is not None and expect_size is not None else None
        try:
            data = _download_once(t, key, s3key, expect_size, digest)
        except ObjectChanged:
            if attempt == _RESTARTS:
                raise StoreUnavailable(
                    f"{t.join(key)} changed (size or ETag) during each of {_RESTARTS} download attempts; "
                    "blobs are meant to be immutable: check for another writer, then retry"
                ) from None
            log.warning("%s changed during download; restarting it", t.join(key))
            continue
        except StoreError:
            raise
        except Exception as exc:
            raise t.error("get", key, exc) from exc
        if digest is not None and (actual := digest.hexdigest()) != sha256:
            raise BlobMismatch(
                f"blob {key!r} ({t.join(key)}) has sha256 {actual[:16]}… but its manifest records {sha256[:16]}…"
            )
        return data
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class RangeGet:
    """A GET of bytes ``start..end`` (inclusive) of one object; :meth:`run` retries it as a whole, truncation included.

    With ``into`` (a view of exactly ``end - start + 1`` bytes, or a function
    returning one, called only once the answer's size is checked) the body
    is read straight into it and ``None`` is returned for the data: a large
    download then costs one copy of its bytes, not a part copy plus a join.
    With ``expect_total``, an object of another size (or a range past its
    end, 416) raises :class:`BlobMismatch` if this request ``confirms`` the
    size (the first answer of a download), else ``ObjectChanged``: a later
    answer disagreeing with an earlier one is not a consistent answer, so
    the download restarts and its first answer decides. With ``etag``, the
    GET is pinned to it (``If-Match``; a 412 is ``ObjectChanged``).
    A chunked ``digest`` (``start`` on a chunk boundary) is fed each chunk as
    soon as it is read, while its bytes are in this core's cache (hashing
    them there is a third faster here than from memory); a retry reads and
    hashes the whole range again.
    """

    key: str
    s3key: str
    start: int
    end: int
    what: str = "get"
    etag: str | None = None
    into: memoryview | Callable[[], memoryview] | None = None
    expect_total: int | None = None
    digest: BlobDigest | None = None
    confirms: bool = False

    def run(self, t: S3Target) -> tuple[bytes | None, dict]:
        """``(data, response)``; ``data`` is None when read ``into`` a buffer."""
        return t.retry(self.what, self.key, functools.partial(self._once, t))

    def _once(self, t: S3Target) -> tuple[bytes | None, dict]:
        resp = self._request(t)
        body = resp["Body"]
        declared = resp.get("ContentLength")
        try:
            total = total_size(resp, declared if declared is not None else -1)
            if self.expect_total is not None and total != self.expect_total:
                raise self._wrong_size(t, total)
            if self.into is not None:
                self._read_into(t, body, declared)
                return None, resp
            # StreamingBody.read() checks Content-Length and raises
            # IncompleteReadError on a short body; check the range too.
            data = body.read()
        finally:
            body.close()
        if declared is not None and len(data) != declared:
            raise TruncatedBody(f"got {len(data)} of {declared} bytes")
        return data, resp

    def _request(self, t: S3Target) -> dict:
        args: dict[str, Any] = {"Bucket": t.bucket, "Key": self.s3key, "Range": f"bytes={self.start}-{self.end}"}
        if self.etag is not None:
            args["IfMatch"] = self.etag
        try:
            return t.client.get_object(**args)
        except Exception as exc:
            if self.etag is not None and status(exc) == 412:
                raise ObjectChanged() from exc
            if self.expect_total is not None and status(exc) == 416:  # a range past the object's end
                raise self._wrong_size(t, None) from exc
            raise

    def _read_into(self, t: S3Target, body: Any, declared: int | None) -> None:
        target = self.into() if callable(self.into) else self.into
        assert target is not None
        if declared is not None and declared != len(target):
            raise StoreUnavailable(
                f"S3 get of {t.join(self.key)} returned {declared} bytes for range {self.start}-{self.end}; "
                "the server does not honour ranged GETs correctly"
            )
        got = read_into(body, target, self.digest, self.start)
        if got != len(target):
            raise TruncatedBody(f"got {got} of {len(target)} bytes")

    def _wrong_size(self, t: S3Target, total: int | None) -> Exception:
        """``total``: the size the answer gave, None for a 416 (the object ends before ``start``)."""
        if not self.confirms:
            return ObjectChanged()
        if total is None:
            return BlobMismatch(
                f"blob {self.key!r} ({t.join(self.key)}) is shorter than the {self.expect_total} bytes "
                "its manifest records"
            )
        return BlobMismatch(
            f"blob {self.key!r} ({t.join(self.key)}) has {total} bytes but its manifest records {self.expect_total}"
        )


def _download_once(t: S3Target, key: str, s3key: str, expect_size: int | None,
                   digest: BlobDigest | None) -> bytes | memoryview:
    chunk = t.options.download_part_size
    if expect_size is not None and expect_size > chunk:
        return _download_known_size(t, key, s3key, expect_size, digest)
    try:
        first, resp = RangeGet(key, s3key, 0, chunk - 1).run(t)
    except Exception as exc:
        if status(exc) != 416:
            raise
        first, resp = _get_whole(t, key, s3key)  # a zero-byte object has no byte 0 to range over
    assert first is not None
    total = total_size(resp, len(first))
    if expect_size is not None and total != expect_size:
        raise BlobMismatch(f"blob {key!r} ({t.join(key)}) has {total} bytes but its manifest records {expect_size}")
    if len(first) != min(total, chunk):
        raise StoreUnavailable(
            f"S3 get of {t.join(key)} returned {len(first)} bytes for the first {min(total, chunk)}; "
            "the server does not honour ranged GETs correctly"
        )
    if total <= chunk:
        if digest is not None:
            digest.update(0, first)
        return first
    # Only a plain get() (no digest) gets here: a verified one knows the size.
    # One buffer for the whole object (its size the server's own answer),
    # each ranged GET reading into its slice.
    buffer = Buffer(total)
    buffer.slice(0, len(first))[:] = first
    del first
    ranges = ((off, min(off + chunk, total) - 1) for off in range(chunk, total, chunk))
    _get_ranges(t, key, s3key, buffer, ranges, 2, resp.get("ETag"), None, None)
    return buffer.view


def _download_known_size(t: S3Target, key: str, s3key: str, size: int, digest: BlobDigest | None) -> memoryview:
    """Ranged GETs of a blob whose manifest gives its size: no request alone to learn it.

    The size is a manifest's claim, so nothing is allocated until the first
    answer's Content-Range total has matched it (the other ranges wait for
    its headers only, not its body). The answers must agree with each other
    on the ETag (else the object changed mid-download). The ranges hold
    whole chunks of a chunked digest, so each can be hashed alone.
    """
    part = t.options.download_part_size
    step = digest.piece_size(part) if digest is not None else part
    buffer = Buffer(size)
    ranges = ((off, min(off + step, size) - 1) for off in range(0, size, step))
    if len(_get_ranges(t, key, s3key, buffer, ranges, 1, None, size, digest)) > 1:
        raise ObjectChanged()
    return buffer.view


def _get_ranges(
    t: S3Target,
    key: str,
    s3key: str,
    buffer: Landing,
    ranges: Iterator[tuple[int, int]],
    first_number: int,
    etag: str | None,
    expect_total: int | None,
    digest: BlobDigest | None,
) -> set[str | None]:
    """GET ``ranges`` in parallel into their slices of ``buffer`` (a :class:`Buffer`, or a
    :class:`FileSink` that each worker writes its range to once whole), feeding ``digest``
    (a chunked one as each worker reads, a plain one here in order as the
    ranges complete, later ones downloading meanwhile: a :class:`Buffer`'s only).
    Returns the ETags the answers carried.

    The first range goes alone until its answer has confirmed the size and
    the buffer exists; then at most ``2 * max_concurrency`` ranges are in
    flight (queued or running): enough to keep every worker busy while the
    oldest completes, and a bounded cost however many ranges there are.
    """
    in_worker = digest is not None and digest.any_order
    pool = t.executor()
    numbered = enumerate(ranges, start=first_number)
    pending: collections.deque[tuple[int, int, concurrent.futures.Future]] = collections.deque()

    def submit() -> bool:
        item = next(numbered, None)
        if item is None:
            return False
        n, (a, b) = item
        get = RangeGet(key, s3key, a, b, "get" if n == 1 else f"get part {n}", etag,
                       functools.partial(buffer.slice, a, b + 1), expect_total,
                       digest if in_worker else None, n == first_number)
        pending.append((a, b, pool.submit(_get_range, t, get, buffer)))
        return True

    etags = set()
    try:
        submit()
        buffer.wait_allocated(pending[0][2])
        while len(pending) < 2 * t.max_concurrency and submit():
            pass
        while pending:
            a, b, fut = pending[0]
            _, resp = fut.result()
            pending.popleft()
            etags.add(resp.get("ETag"))
            if digest is not None and not in_worker:
                digest.update(a, buffer.view[a : b + 1])
            submit()
    except BaseException:
        for *_, f in pending:
            f.cancel()
        concurrent.futures.wait([f for *_, f in pending])
        raise
    return etags


def _get_range(t: S3Target, get: RangeGet, buffer: Landing) -> tuple[bytes | None, dict]:
    """One range, retried as a whole, then handed to ``buffer`` (by the worker that read it)."""
    out = get.run(t)
    buffer.landed(get.start, get.end + 1)
    return out


def download_to_file(t: S3Target, key: str, s3key: str, fd: int, *, size: int, etag: str,
                     digest: BlobDigest | None) -> set[str | None]:
    """Write the ``size``-byte object at ``s3key`` into the open file ``fd`` at its offsets, every GET
    pinned to ``etag`` (``If-Match``); the ETags the answers carried, for the caller to compare with
    ``etag`` (a server may ignore the header).

    An object of one ``download_part_size`` or less (or of one ``digest``
    chunk) is one GET; a larger one parallel ranged GETs, as a checkpoint blob
    is read (:func:`_get_ranges`: the first alone until its size is checked,
    then at most ``2 * max_concurrency`` in flight), each range read into its
    worker's own buffer, hashed there chunk by chunk, and written at its offset
    (:class:`FileSink`): memory is ``max_concurrency`` ranges, whatever the
    size. Each range is retried alone under the store's policy, a truncated
    one included. Raises ``ObjectChanged`` on a 412 or on a later answer of
    another size, :class:`BlobMismatch` when the first answer's size is not
    ``size``, the store's retry error when attempts run out, and the client's
    own error for anything not transient (the caller maps it). A zero-byte
    object has no range to ask for: call for ``size > 0`` only.
    """
    assert size > 0, "a zero-byte object has no byte range"
    part = t.options.download_part_size
    step = digest.piece_size(part) if digest is not None else part
    if digest is not None and not digest.any_order:
        step = size  # a plain digest (one chunk or less) is fed in order: one range
    sink = FileSink(fd, size, min(step, size))
    if size <= step:
        get = RangeGet(key, s3key, 0, size - 1, "get", etag, functools.partial(sink.slice, 0, size), size, digest,
                       True)
        return {_get_range(t, get, sink)[1].get("ETag")}
    ranges = ((off, min(off + step, size) - 1) for off in range(0, size, step))
    return _get_ranges(t, key, s3key, sink, ranges, 1, etag, size, digest)


def _get_whole(t: S3Target, key: str, s3key: str) -> tuple[bytes, dict]:
    def once() -> tuple[bytes, dict]:
        resp = t.client.get_object(Bucket=t.bucket, Key=s3key)
        body = resp["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        return data, resp

    return t.retry("get", key, once)


__all__ = ["RangeGet", "download", "download_to_file"]
