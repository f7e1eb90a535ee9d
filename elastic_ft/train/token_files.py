"""The token store's files: assembled from the ranks' parts, cut into blobs, and the node's verified copy.

:func:`assemble` concatenates the parts in rank order into the store's files
(so the bytes do not depend on how many ranks built them); :func:`upload_files`
cuts a file into blobs of at most :data:`PIECE_BYTES`; :func:`localize` gives a
node its copy of a committed store under ``<node cache>/tokens/<identity>/``:
fetched a piece at a time and checked against the manifest once, then trusted
while its files keep the size, mtime, ctime, inode and device recorded before
they were hashed, for a manifest of the same content (``verified.json``: the blobs' names, sizes and
sha256, not the run or writer that committed them, since every run on the node with the same data shares
the copy; why that is sound,
and what it cannot see: :mod:`elastic_ft.train.token_build`). Several ranks of
a node share a copy under a file lock; work directories
(:func:`~elastic_ft.train.token_workdirs.scratch`) are
locked while in use, so what a killed process left is found and removed.

Cost: assembling, one pass over the tokens; a fetch, one download (memory:
one piece; a fetch cut short is resumed from its last whole piece); a start with a verified copy, a few
stats.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator

import numpy as np

from elastic_ft.checkpoint.digest import CHUNK_SIZE, HASH_THREADS, file_blob_sha256
from elastic_ft.checkpoint.errors import BlobMismatch, ObjectNotFound
from elastic_ft.checkpoint.manifest import BlobRef
from elastic_ft.checkpoint.stamp import file_stamp, stat_stamp
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointWriter
from elastic_ft.config import DataConfig
from elastic_ft.train.datafiles import DataError
from elastic_ft.train.token_packing import pack
from elastic_ft.train.token_store import FILES, Header
from elastic_ft.train.token_workdirs import locked, sweep_scratch

log = logging.getLogger(__name__)

PIECE_BYTES = 64 << 20
"""The largest blob a store file is cut into (a multiple of the digest's chunk): what a node holds in
memory while it fetches the store, whatever the store's size."""


class _Sink:
    """An output file that takes a byte budget (None: unlimited) and drops what exceeds it."""

    def __init__(self, path: str, budget: int | None) -> None:
        self.f, self.left = open(path, "wb"), budget

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        if self.left is not None:
            data = data[: self.left]
            self.left -= len(data)
        self.f.write(data)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def assemble(parts: list, cfg: DataConfig, dtype: np.dtype, pad_id: int, vocab_size: int, ident: str,
             out: str) -> Header:
    """The store's files in ``out`` from ``parts`` in rank order; each part is a callable ``read(name)``
    yielding the bytes of its part file ``name`` in order (a local file, or its pieces from the store)."""
    lengths = np.concatenate([np.frombuffer(b"".join(bytes(b) for b in read("lengths.bin")), dtype="<i8")
                              for read in parts]) if parts else np.zeros(0, np.int64)
    length = cfg.max_length
    samples = len(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
    if samples == 0:
        raise DataError(f"data yields no samples; add data")
    # Packing: whole samples (cut at max_length when tokenized) placed into max_length rows, decided here from
    # the lengths alone, so the rows do not depend on how many ranks tokenized.
    rows, row_samples = pack(lengths, length) if cfg.packing else (np.zeros(0, "<i8"), np.zeros(0, "<i8"))
    used = int(offsets[-1])
    os.makedirs(out, exist_ok=True)
    for name, width in (("tokens.bin", dtype.itemsize), ("trained.bin", 1)):
        sink = _Sink(os.path.join(out, name), used * width)
        for read in parts:
            for piece in read(name):
                sink.write(piece)
        sink.close()
    for name, array in (("rows.bin", rows), ("row_samples.bin", row_samples)):
        with open(os.path.join(out, name), "wb") as f:
            f.write(array.astype("<i8").tobytes())
    with open(os.path.join(out, "offsets.bin"), "wb") as f:
        f.write(offsets.tobytes())
    with open(os.path.join(out, "targets.bin"), "wb") as f:
        for read in parts:
            for piece in read("targets.bin"):
                f.write(piece)
    header = Header(dtype=dtype.str, samples=samples, tokens=used, max_length=length, pad_id=pad_id,
                    vocab_size=vocab_size, identity=ident, rows=max(0, len(rows) - 1))
    with open(os.path.join(out, "header.json"), "wb") as f:
        f.write(header.to_json())
    return header


def local_reader(directory: str):
    def read(name: str) -> Iterator[bytes]:
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(PIECE_BYTES):
                yield chunk
    return read


def store_reader(store: ObjectStore, refs: dict[str, list[BlobRef]]):
    def read(name: str) -> Iterator[bytes | memoryview]:
        for ref in refs[name]:
            yield store.get_verified(ref.key, size=ref.size, sha256=ref.sha256, chunk_size=ref.chunk_size)
    return read


# ---------------------------------------------------------------- blobs of files


def upload_files(writer: CheckpointWriter, directory: str, names, prefix: str) -> dict[str, list[BlobRef]]:
    """Each file of ``directory`` named in ``names`` as blobs of at most :data:`PIECE_BYTES` under ``prefix``."""
    out: dict[str, list[BlobRef]] = {}
    for name in names:
        refs = []
        with open(os.path.join(directory, name), "rb") as f:
            for n in itertools.count():
                piece = f.read(PIECE_BYTES)
                if not piece and n:
                    break
                refs.append(writer.put_blob(f"{prefix}{name}/{n:05d}", piece))
                if len(piece) < PIECE_BYTES:
                    break
        out[name] = refs
    return out


def blob_name(name: str, n: int) -> str:
    return f"{name}/{n:05d}"


def _pieces(manifest) -> dict[str, list[BlobRef]]:
    """The manifest's blobs grouped by store file, in piece order."""
    out: dict[str, list[BlobRef]] = {}
    for blob, ref in sorted(manifest.blobs.items()):
        name, _, _ = blob.rpartition("/")
        out.setdefault(name, []).append(ref)
    return out


def verify_file(path: str, refs: list[BlobRef]) -> str | None:
    """Why the local file ``path`` is not the concatenation of ``refs``' blobs (None: it is), hashing it
    chunk by chunk with ``pread`` (memory: one chunk per thread)."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        return f"{path}: {exc}"
    if size != sum(r.size for r in refs):
        return f"{path} has {size} bytes, the store's manifest records {sum(r.size for r in refs)}"
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for ref in refs:
            try:
                actual = file_blob_sha256(fd, offset, ref.size, ref.chunk_size or CHUNK_SIZE,
                                          threads=HASH_THREADS)
            except ValueError as exc:
                return f"{path}: {exc}"
            if actual != ref.sha256:
                return f"{path}: bytes {offset}..{offset + ref.size} differ from blob {ref.key}"
            offset += ref.size
    finally:
        os.close(fd)
    return None


# ---------------------------------------------------------------- the node copy


def _stamp(directory: str) -> dict[str, list[int]]:
    """Per store file: its :func:`~elastic_ft.checkpoint.stamp.file_stamp` (size, mtime, ctime, inode, device)."""
    return {name: file_stamp(os.path.join(directory, name)) for name in FILES}


def content_digest(manifest) -> str:
    """sha256 of what the manifest says the files hold (each blob's name, size and digest): the store's
    bytes, not who wrote it or when. The node copy is shared by every run on the node that uses the same
    data (its directory is named by the identity, not the run): two runs' manifests of one identity differ
    in writer and time, never in these."""
    return blobs_digest(manifest.blobs)


def blobs_digest(blobs: dict[str, BlobRef]) -> str:
    """:func:`content_digest` of a manifest that would name ``blobs``."""
    doc = sorted((name, ref.size, ref.sha256) for name, ref in blobs.items())
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def mark_verified(directory: str, manifest, stamp: dict | None = None) -> None:
    """Record that ``directory``'s files are ``manifest``'s bytes, as they are now (or as ``stamp``, taken
    before they were hashed)."""
    doc = {"manifest": content_digest(manifest), "files": stamp or _stamp(directory)}
    tmp = os.path.join(directory, f".verified.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(directory, "verified.json"))


def marked(directory: str, manifest) -> bool:
    """Whether ``directory`` was verified as ``manifest``'s bytes (by content, whichever run committed it)
    and its files keep the stamp they had then."""
    try:
        with open(os.path.join(directory, "verified.json"), encoding="utf-8") as f:
            doc = json.load(f)
        return doc.get("manifest") == content_digest(manifest) and doc.get("files") == _stamp(directory)
    except (OSError, ValueError, AttributeError):
        return False


def install(out: str, final: str, manifest) -> bool:
    """The leader's assembled files ``out`` (hashed as they were uploaded: ``manifest``'s bytes) as the
    node copy ``final``, unless ``final`` already holds them verified (another run of the same data, or
    an earlier world of this one): that copy is kept, never replaced under the processes that map it.
    Call under ``final``'s lock; whether it installed."""
    if os.path.isdir(final) and marked(final, manifest):
        return False
    replace_dir(out, final)
    mark_verified(final, manifest)
    return True


class StoreTorn(Exception):
    """A committed store's blob does not match its manifest."""


def localize(store: ObjectStore, manifest, node_root: str, ident: str) -> str:
    """The node's verified copy of the committed store (fetched if missing or wrong); raises
    :class:`StoreTorn` when the run's store holds a blob that does not match the manifest."""
    final = os.path.join(node_root, ident)
    pieces = _pieces(manifest)
    with locked(final + ".lock"):
        if os.path.isdir(final):
            if marked(final, manifest):
                return final
            before = _stamp(final)
            problems = [p for name, refs in pieces.items() if (p := verify_file(os.path.join(final, name), refs))]
            if not problems and _stamp(final) == before:  # recorded as hashed: a write meanwhile is not trusted
                mark_verified(final, manifest, before)
                return final
            log.warning("token store: the node copy is not the committed store (%s); fetching it", problems[0])
        sweep_scratch(node_root)  # what lost builds left on this node
        _fetch(store, manifest, pieces, final)
        mark_verified(final, manifest)
        return final


PARTIAL = ".partial-"
"""Infix of a node's fetch in progress: ``<identity>.partial-<content digest>``, kept when a fetch is cut short
(a store error, a rank killed, a new world), so the next start on the node fetches only the rest."""


def _fetch(store: ObjectStore, manifest, pieces: dict[str, list[BlobRef]], final: str) -> None:
    """Fetch the committed store into ``final`` piece by piece, each verified as it arrives and recorded
    (with its file's stamp) once fsynced, resuming a fetch of the same content that was cut short. Under
    ``final``'s lock. A resumed file whose stamp moved since (anything wrote it) is fetched again from its
    start; fetches of other contents under this identity are removed."""
    partial = f"{final}{PARTIAL}{content_digest(manifest)[:16]}"
    for name in os.listdir(os.path.dirname(final)):
        stale = os.path.join(os.path.dirname(final), name)
        if name.startswith(os.path.basename(final) + PARTIAL) and stale != partial:
            shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(partial, exist_ok=True)
    record = os.path.join(partial, ".progress.json")
    try:
        with open(record, encoding="utf-8") as f:
            progress = json.load(f)
        if not isinstance(progress, dict):
            progress = {}
    except (OSError, ValueError):
        progress = {}
    for name, refs in pieces.items():
        path = os.path.join(partial, name)
        entry = progress.get(name)
        done, stamp = entry if isinstance(entry, list) and len(entry) == 2 else (0, None)
        try:
            same = file_stamp(path) == stamp
        except OSError:
            same = False
        done = done if same and isinstance(done, int) and 0 <= done <= len(refs) else 0
        if done == len(refs) and refs:
            continue  # whole, and untouched since it was recorded
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            keep = sum(r.size for r in refs[:done])
            f.truncate(keep)
            f.seek(keep)
            for n in range(done, len(refs)):
                ref = refs[n]
                try:
                    f.write(store.get_verified(ref.key, size=ref.size, sha256=ref.sha256, chunk_size=ref.chunk_size))
                except (BlobMismatch, ObjectNotFound) as exc:
                    shutil.rmtree(partial, ignore_errors=True)  # that store is never used: nothing to resume
                    raise StoreTorn(str(exc)) from exc
                f.flush()
                os.fsync(f.fileno())
                progress[name] = [n + 1, stat_stamp(os.fstat(f.fileno()))]
                tmp = f"{record}.tmp"
                with open(tmp, "w", encoding="utf-8") as out:
                    json.dump(progress, out)
                os.replace(tmp, record)
    os.remove(record)
    replace_dir(partial, final)


def replace_dir(src: str, dst: str) -> None:
    if os.path.isdir(dst):
        gone = f"{dst}.gone-{uuid.uuid4().hex[:8]}"
        os.rename(dst, gone)
        shutil.rmtree(gone, ignore_errors=True)
    os.rename(src, dst)


__all__ = ["PIECE_BYTES", "StoreTorn", "assemble", "blob_name", "blobs_digest", "content_digest", "install",
           "local_reader", "localize", "mark_verified", "marked", "replace_dir", "store_reader", "upload_files",
           "verify_file"]
