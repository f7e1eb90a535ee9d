"""Tokenize once per run: build the token store, commit it to the run's location, map it on every node.

The store (:mod:`elastic_ft.train.token_store`) is named by its identity: the
sha256 of the format, the data files' contents, the tokenizer's serialized
form and the data settings that change tokens (:func:`identity`). It is kept
in the run's store under ``tokens/<identity>/`` with the checkpoint protocol
(:mod:`elastic_ft.checkpoint.writer`): blobs first (each file cut into pieces
of at most :data:`PIECE_BYTES`, each with its size and sha256), then one
manifest written last and create-if-absent. It exists only once that manifest
does, and every byte is checked against it when it lands on a node.

:func:`ensure` is called by every rank at every start:

1. Every rank computes the identity. A data file's digest is read from the
   node's record of (path, size, mtime, inode) -> sha256, so a restart reads no
   data file; a file whose stat changed is hashed again.
2. The leader reads the manifest and tells the others. None: the world builds
   it. Each rank tokenizes a contiguous share of the records, streamed (no rank
   holds more than a batch of records as Python objects), into part files; the
   other ranks upload theirs; the leader concatenates the parts in rank order
   into the final files (byte-identical whatever the world's size), uploads
   them and commits the manifest, then deletes the parts.
3. Each node maps its copy under ``<node cache>/tokens/<identity>/``: fetched
   piece by piece (memory: one piece) and verified, once; a later start on the
   node trusts the copy while its files keep the size, mtime and inode they had
   when they were verified. A blob of the run's store whose bytes do not match
   its manifest (torn, altered) is never used: the manifest is retired to
   ``quarantine/`` and the store is built again.

Cost: a start with a committed store and a node copy: one manifest read and a
few stats, nothing that grows with the dataset. A node without a copy: one
download of the store (about 3 bytes per token), hashed once. A build: one
tokenization pass over the data, shared by the ranks, plus each part's upload
and the leader's concatenation (one pass over the tokens).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic_ft.checkpoint.digest import CHUNK_SIZE, BlobDigest
from elastic_ft.checkpoint.errors import BlobMismatch, ObjectNotFound
from elastic_ft.checkpoint.manifest import BlobRef, ManifestError, manifest_key
from elastic_ft.checkpoint.prefixed import PrefixedStore
from elastic_ft.checkpoint.reader import read_manifest
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointConflict, CheckpointWriter, Snapshot, retire
from elastic_ft.config import DataConfig
from elastic_ft.train.datafiles import DataError, kind_of, missing_field_error, needed_fields
from elastic_ft.train.token_store import FORMAT, Header, TokenStore, read_header, token_dtype
from elastic_ft.train.world import World, broadcast_from_leader, gather_from_all

log = logging.getLogger(__name__)

PIECE_BYTES = 64 << 20
"""The largest blob a store file is cut into (a multiple of the digest's chunk): what a node holds in
memory while it fetches the store, whatever the store's size."""
RECORD_BATCH = 1024
"""Records tokenized per tokenizer call: large enough for the fast tokenizer's threads, small enough that a
batch's Python lists stay a few MB."""
STORE_PREFIX = "tokens/"
_PART_FILES = ("tokens.bin", "trained.bin", "lengths.bin", "targets.bin")
_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


# ---------------------------------------------------------------- identity


def data_format(cfg: DataConfig) -> str | None:
    """The format of the spec's local files (None for a hub dataset); :class:`DataError` if unknown."""
    if cfg.dataset:
        return None
    missing = [f for f in cfg.files if not os.path.isfile(f)]
    if missing:
        raise DataError(f"data.files: {missing[0]!r} does not exist")
    fmt = cfg.format or _FORMATS.get(os.path.splitext(cfg.files[0])[1].lower())
    if fmt is None:
        raise DataError(f"data.format: cannot infer the format of {cfg.files[0]!r}; set data.format to json, parquet or text")
    return fmt


def token_settings(cfg: DataConfig, fmt: str | None) -> dict[str, Any]:
    """The data settings that change the tokens (not the files' paths: their contents are hashed)."""
    return {"format": fmt, "dataset": cfg.dataset, "split": cfg.split if cfg.dataset else None,
            "text_field": cfg.text_field, "prompt_field": cfg.prompt_field, "response_field": cfg.response_field,
            "max_length": cfg.max_length, "packing": cfg.packing}


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's serialized form and the special ids training uses."""
    h = hashlib.sha256()
    h.update(json.dumps({"class": type(tokenizer).__name__, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                         "pad": tokenizer.pad_token_id, "size": len(tokenizer)}, sort_keys=True).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
        return h.hexdigest()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # a slow tokenizer: its saved files
        tokenizer.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            h.update(name.encode() + b"\0")
            with open(os.path.join(tmp, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def identity(settings: dict[str, Any], file_digests: list[str], tokenizer_digest: str, extra: str = "") -> str:
    """The store's name: sha256 of the format, the settings, each data file's digest in order, the tokenizer."""
    doc = {"format": FORMAT, "settings": settings, "files": file_digests, "tokenizer": tokenizer_digest, "extra": extra}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class FileDigests:
    """sha256 of local files, remembered per (path, size, mtime, inode) in ``path``: a file hashed once on a
    node is not read again until it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, encoding="utf-8") as f:
                self.known = json.load(f)
            if not isinstance(self.known, dict):
                self.known = {}
        except (OSError, ValueError):
            self.known = {}

    def digest(self, path: str) -> str:
        st = os.stat(path)
        real = os.path.realpath(path)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = self.known.get(real)
        if isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        self.known[real] = {"stat": stamp, "sha256": h.hexdigest()}
        self._save()
        return h.hexdigest()

    def _save(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.known, f)
            os.replace(tmp, self.path)
        except OSError as exc:  # the next start hashes again: slower, never wrong
            log.warning("token store: could not record data file digests in %s: %s", self.path, exc)


# ---------------------------------------------------------------- records, streamed


class Records:
    """The spec's records, counted, then read in batches of columns by index range."""

    def __init__(self, cfg: DataConfig, fmt: str | None) -> None:
        self.cfg, self.fmt = cfg, fmt
        self.fields = list(needed_fields(cfg))
        self._dataset = None
        if fmt == "json" and all(_first_is_object(p) for p in cfg.files):
            self.count = sum(1 for _ in _json_lines(cfg.files, parse=False))
        else:
            self._dataset = _load_dataset(cfg, fmt)
            columns = set(self._dataset.column_names)
            for field in self.fields:
                if field not in columns:
                    raise missing_field_error(field, columns)
            self.count = len(self._dataset)

    def batches(self, lo: int, hi: int, size: int = RECORD_BATCH) -> Iterator[tuple[int, dict[str, list]]]:
        """``(index of the first record, {field: values})`` for records ``lo .. hi - 1``."""
        if self._dataset is not None:
            for start in range(lo, hi, size):
                try:
                    yield start, {f: list(self._dataset[start:min(hi, start + size)][f]) for f in self.fields}
                except UnicodeDecodeError as exc:
                    raise DataError(f"data holds text that is not UTF-8 ({exc.reason}); fix the data") from exc
            return
        rows = itertools.islice(_json_lines(self.cfg.files, parse=True, skip=lo), hi - lo)
        start = lo
        while batch := list(itertools.islice(rows, size)):
            yield start, {f: [row.get(f) for row in batch] for f in self.fields}
            start += len(batch)


def _first_is_object(path: str) -> bool:
    """Whether a JSON file is JSON Lines of objects (its first non-blank line is one object), not one document."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            text = raw.lstrip(codecs.BOM_UTF8) if n == 0 else raw
            if text.strip():
                try:
                    return isinstance(json.loads(text), dict)
                except ValueError:
                    return False
    return False


def _json_lines(paths: list[str], *, parse: bool, skip: int = 0) -> Iterator[Any]:
    """The non-blank lines of JSON Lines files in order (parsed when ``parse``), the first ``skip`` unparsed."""
    seen = 0
    for path in paths:
        with open(path, "rb") as f:
            for n, raw in enumerate(f):
                if n == 0:
                    raw = raw.lstrip(codecs.BOM_UTF8)
                if not raw.strip():
                    continue
                seen += 1
                if seen <= skip:
                    continue
                yield json.loads(raw) if parse else None


def _load_dataset(cfg: DataConfig, fmt: str | None):
    import datasets

    datasets.disable_progress_bars()
    if cfg.dataset:
        try:
            return datasets.load_dataset(cfg.dataset, split=cfg.split)
        except Exception as exc:
            raise DataError(f"data.dataset {cfg.dataset!r} (split {cfg.split!r}) could not be loaded: {exc}") from exc
    try:
        return datasets.load_dataset(fmt, data_files=list(cfg.files), split="train")
    except Exception as exc:
        raise DataError(f"data.files {cfg.files!r} could not be read as {fmt}: {exc}") from exc


# ---------------------------------------------------------------- tokenizing a share


def encode(columns: dict[str, list], first: int, cfg: DataConfig, tokenizer) -> tuple[list[list[int]], list[int]]:
    """The token ids of each record and how many of its leading tokens are not trained.

    Records are numbered from ``first`` (0-based, across all files) for errors. A sample is BOS, the
    prompt, the response, EOS (or BOS, the text, EOS), cut at ``max_length`` unless packing (then cut into
    blocks later); a prompt is not trained.
    """
    def texts(field: str) -> list[str]:
        values = columns[field]
        for k, text in enumerate(values):
            if not isinstance(text, str):
                raise DataError(f"data record {first + k + 1}: field {field!r} is {kind_of(text)}, not text; "
                                f"fix or remove that record")
        return tokenizer(values, add_special_tokens=False)["input_ids"]

    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = [bos] if bos is not None else []
    cut = None if cfg.packing else cfg.max_length
    if cfg.prompt_field:
        prompts, responses = texts(cfg.prompt_field), texts(cfg.response_field)
        samples = [prefix + p + r + [eos] for p, r in zip(prompts, responses)]
        untrained = [len(prefix) + len(p) for p in prompts]
    else:
        samples = [prefix + ids + [eos] for ids in texts(cfg.text_field)]
        untrained = [0] * len(samples)
    if cut is not None:
        samples = [s[:cut] for s in samples]
        untrained = [min(u, cut) for u in untrained]
    return samples, untrained


def tokenize_share(records: Records, lo: int, hi: int, cfg: DataConfig, tokenizer, dtype: np.dtype, out: str) -> None:
    """Records ``lo .. hi - 1`` as part files in ``out``: tokens, trained marks, sample lengths and targets."""
    os.makedirs(out, exist_ok=True)
    files = {name: open(os.path.join(out, name), "wb") for name in _PART_FILES}
    try:
        for first, columns in records.batches(lo, hi):
            samples, untrained = encode(columns, first, cfg, tokenizer)
            lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
            total = int(lengths.sum())
            files["tokens.bin"].write(np.fromiter(itertools.chain.from_iterable(samples), dtype=dtype, count=total).tobytes())
            marks = np.ones(total, dtype=np.uint8)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            for s, u in zip(starts, untrained):
                marks[s:s + u] = 0
            files["trained.bin"].write(marks.tobytes())
            files["lengths.bin"].write(lengths.astype("<i8").tobytes())
            # Loss positions after the shift: trained tokens but a sample's first position.
            first_marks = marks[starts] if len(starts) else np.zeros(0, np.uint8)
            trained = np.add.reduceat(marks, starts, dtype=np.int64) if total else np.zeros(len(samples), np.int64)
            targets = trained.astype(np.int64) - (first_marks.astype(np.int64) * (lengths > 0))
            files["targets.bin"].write(targets.astype("<i8").tobytes())
    finally:
        for f in files.values():
            f.close()


def share(count: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``count`` records among ``size`` ranks."""
    return count * rank // size, count * (rank + 1) // size


# ---------------------------------------------------------------- assembling the parts


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
    total = int(lengths.sum())
    length = cfg.max_length
    if cfg.packing:
        samples = total // length
        offsets = np.arange(0, samples * length + 1, length, dtype="<i8")
        targets = np.full(samples, length - 1, dtype="<i8")
    else:
        samples = len(lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
        targets = None
    if samples == 0:
        raise DataError(f"data yields no samples of max_length {length}; add data or lower data.max_length")
    used = int(offsets[-1])
    os.makedirs(out, exist_ok=True)
    for name, width in (("tokens.bin", dtype.itemsize), ("trained.bin", 1)):
        sink = _Sink(os.path.join(out, name), used * width)
        for read in parts:
            for piece in read(name):
                sink.write(piece)
        sink.close()
    with open(os.path.join(out, "offsets.bin"), "wb") as f:
        f.write(offsets.tobytes())
    with open(os.path.join(out, "targets.bin"), "wb") as f:
        if targets is not None:
            f.write(targets.tobytes())
        else:
            for read in parts:
                for piece in read("targets.bin"):
                    f.write(piece)
    header = Header(dtype=dtype.str, samples=samples, tokens=used, max_length=length, pad_id=pad_id,
                    vocab_size=vocab_size, identity=ident)
    with open(os.path.join(out, "header.json"), "wb") as f:
        f.write(header.to_json())
    return header


def _local_reader(directory: str):
    def read(name: str) -> Iterator[bytes]:
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(PIECE_BYTES):
                yield chunk
    return read


def _store_reader(store: ObjectStore, refs: dict[str, list[BlobRef]]):
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


def _blob_name(name: str, n: int) -> str:
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
    import concurrent.futures

    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for ref in refs:
            digest = BlobDigest(ref.size, ref.chunk_size or CHUNK_SIZE)
            step = CHUNK_SIZE if digest.any_order else ref.size
            starts = range(0, ref.size, step) if ref.size else [0]

            def piece(start: int, base=offset, ref=ref, step=step) -> tuple[int, bytes]:
                return start, os.pread(fd, min(step, ref.size - start), base + start)

            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
                for start, data in pool.map(piece, starts):
                    digest.update(start, data)
            if digest.hexdigest() != ref.sha256:
                return f"{path}: bytes {offset}..{offset + ref.size} differ from blob {ref.key}"
            offset += ref.size
    finally:
        os.close(fd)
    return None


# ---------------------------------------------------------------- the node copy


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


def _stamp(directory: str) -> dict[str, list[int]]:
    out = {}
    for name in ("tokens.bin", "trained.bin", "offsets.bin", "targets.bin", "header.json"):
        st = os.stat(os.path.join(directory, name))
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def _mark_verified(directory: str, manifest) -> None:
    doc = {"writer": manifest.writer, "created": manifest.created, "files": _stamp(directory)}
    tmp = os.path.join(directory, f".verified.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(directory, "verified.json"))


def _marked(directory: str, manifest) -> bool:
    try:
        with open(os.path.join(directory, "verified.json"), encoding="utf-8") as f:
            doc = json.load(f)
        return (doc.get("writer"), doc.get("created")) == (manifest.writer, manifest.created) and \
            doc.get("files") == _stamp(directory)
    except (OSError, ValueError, AttributeError):
        return False


class StoreTorn(Exception):
    """A committed store's blob does not match its manifest."""


def localize(store: ObjectStore, manifest, node_root: str, ident: str) -> str:
    """The node's verified copy of the committed store (fetched if missing or wrong); raises
    :class:`StoreTorn` when the run's store holds a blob that does not match the manifest."""
    final = os.path.join(node_root, ident)
    pieces = _pieces(manifest)
    with _locked(final + ".lock"):
        if os.path.isdir(final):
            if _marked(final, manifest):
                return final
            problems = [p for name, refs in pieces.items() if (p := verify_file(os.path.join(final, name), refs))]
            if not problems:
                _mark_verified(final, manifest)
                return final
            log.warning("token store: the node copy is not the committed store (%s); fetching it", problems[0])
        tmp = os.path.join(node_root, f".fetch-{uuid.uuid4().hex[:12]}")
        os.makedirs(tmp)
        try:
            for name, refs in pieces.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    for ref in refs:
                        try:
                            f.write(store.get_verified(ref.key, size=ref.size, sha256=ref.sha256,
                                                       chunk_size=ref.chunk_size))
                        except (BlobMismatch, ObjectNotFound) as exc:
                            raise StoreTorn(str(exc)) from exc
                    f.flush()
                    os.fsync(f.fileno())
            _replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _mark_verified(final, manifest)
        return final


def _replace_dir(src: str, dst: str) -> None:
    if os.path.isdir(dst):
        gone = f"{dst}.gone-{uuid.uuid4().hex[:8]}"
        os.rename(dst, gone)
        shutil.rmtree(gone, ignore_errors=True)
    os.rename(src, dst)


# ---------------------------------------------------------------- the protocol


@dataclasses.dataclass
class Built:
    """What :func:`ensure` did, for events and the bench."""

    identity: str
    built: bool
    seconds: float


def _committed(sub: ObjectStore, run_id: str):
    """The committed store's manifest, or None (absent, or corrupt: then it is retired and rebuilt)."""
    key = manifest_key(0)
    try:
        return read_manifest(sub, key, run_id=run_id)
    except ObjectNotFound:
        return None
    except ManifestError as exc:
        log.warning("token store: %s; building it again", exc)
        retire(sub, key, str(exc))
        return None


def build(world: World, sub: ObjectStore, run_id: str, cfg: DataConfig, fmt: str | None, tokenizer, ident: str,
          node_root: str):
    """Tokenize with every rank of ``world``, commit the store; the manifest on every rank."""
    writer = CheckpointWriter(sub, run_id)
    nonce = uuid.uuid4().hex[:12]
    work = os.path.join(node_root, f".build-{nonce}-{world.rank}")
    vocab = max(len(tokenizer), getattr(tokenizer, "vocab_size", 0) or 0)
    dtype = token_dtype(vocab)
    result: tuple[str | None, dict | None] = (None, None)
    try:
        try:
            records = Records(cfg, fmt)
            lo, hi = share(records.count, world.rank, world.size)
            tokenize_share(records, lo, hi, cfg, tokenizer, dtype, os.path.join(work, "part"))
            refs = None
            if not world.is_leader:
                refs = upload_files(writer, os.path.join(work, "part"), _PART_FILES, f"parts/{nonce}/{world.rank:05d}/")
            result = (None, refs)
        except DataError as exc:
            result = (str(exc), None)
        results = gather_from_all(world, result)
        errors = [e for e, _ in results if e]
        if errors:
            raise DataError(errors[0])
        manifest = None
        if world.is_leader:
            manifest = _assemble_and_commit(world, sub, writer, results, cfg, dtype, tokenizer, vocab, ident, work,
                                            node_root)
        return broadcast_from_leader(world, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _assemble_and_commit(world, sub, writer, results, cfg, dtype, tokenizer, vocab, ident, work, node_root):
    readers = [_local_reader(os.path.join(work, "part"))] + [_store_reader(sub, refs) for _, refs in results[1:]]
    out = os.path.join(work, "store")
    assemble(readers, cfg, dtype, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, vocab,
             ident, out)
    prefix = f"blobs/000000000000-{uuid.uuid4().hex[:8]}/"
    uploaded = upload_files(writer, out, ("tokens.bin", "trained.bin", "offsets.bin", "targets.bin", "header.json"),
                            prefix)
    blobs = {_blob_name(name, n): ref for name, refs in uploaded.items() for n, ref in enumerate(refs)}
    snap = Snapshot(step=0, cursor=0, tensors={}, documents={}, config_hash=ident, world={"size": world.size})
    try:
        manifest = writer.commit_manifest(snap, blobs)
    except CheckpointConflict:  # another job committed the same store first: its bytes are the same
        manifest = read_manifest(sub, manifest_key(0), run_id=writer.run_id)
    for _, refs in results[1:]:
        for ref in itertools.chain.from_iterable(refs.values()):
            sub.delete(ref.key)
    # The leader's node keeps the assembled files: they are the committed bytes (hashed as they went up).
    with _locked(os.path.join(node_root, ident) + ".lock"):
        if manifest.writer == writer.writer_token:
            _replace_dir(out, os.path.join(node_root, ident))
            _mark_verified(os.path.join(node_root, ident), manifest)
    return manifest


def ensure(world: World, run_store: ObjectStore, run_id: str, cfg: DataConfig, tokenizer, node_cache: str) -> tuple[TokenStore, Built]:
    """The run's token store for ``cfg`` and ``tokenizer``, mapped on this rank (built by the world if it
    is not committed yet). Called by every rank alike; ``cfg.files`` are local paths."""
    t0 = time.monotonic()
    node_root = os.path.join(node_cache, "tokens")
    fmt = data_format(cfg)
    extra = ""
    if cfg.dataset:
        extra = getattr(_load_dataset(cfg, fmt), "_fingerprint", "") or ""
    digests = FileDigests(os.path.join(node_root, "files.json"))
    ident = identity(token_settings(cfg, fmt), [digests.digest(p) for p in cfg.files], tokenizer_fingerprint(tokenizer),
                     extra)
    sub = PrefixedStore(run_store, f"{STORE_PREFIX}{ident}")
    built = False
    for attempt in (1, 2):
        manifest = broadcast_from_leader(world, _committed(sub, run_id) if world.is_leader else None)
        if manifest is None:
            if fmt == "json" or fmt == "text":
                from elastic_ft.train.datafiles import check_files

                check_files(cfg, fmt)
            manifest, built = build(world, sub, run_id, cfg, fmt, tokenizer, ident, node_root), True
        problem = None
        try:
            directory = localize(sub, manifest, node_root, ident)
        except StoreTorn as exc:
            problem = str(exc)
        problems = [p for p in gather_from_all(world, problem) if p]
        if not problems:
            break
        log.warning("token store: %s; it is not used, and is built again", problems[0])
        if world.is_leader:
            retire(sub, manifest_key(0), problems[0])
        broadcast_from_leader(world, None)  # the retirement is done before anyone reads again
    else:
        raise DataError(f"the token store {sub.uri} was torn again after it was rebuilt: {problems[0]}; "
                        f"check the checkpoint location's storage")
    store = TokenStore(directory)
    if store.header.identity != ident:
        raise DataError(f"token store {directory} holds {store.header.identity}, not {ident}")
    return store, Built(ident, built, time.monotonic() - t0)


__all__ = ["Built", "FileDigests", "PIECE_BYTES", "Records", "assemble", "build", "encode", "ensure", "identity",
           "localize", "read_header", "share", "tokenize_share", "tokenizer_fingerprint", "verify_file"]
