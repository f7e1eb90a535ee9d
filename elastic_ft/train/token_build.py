"""Tokenize once per run: build the token store, commit it to the run's location, map it on every node.

The store (:mod:`elastic_ft.train.token_store`) is named by its identity: the
sha256 of the format, the data files' contents, the tokenizer's serialized
form and the data settings that change tokens
(:mod:`elastic_ft.train.token_identity`). It is kept
in the run's store under ``tokens/<identity>/`` with the checkpoint protocol
(:mod:`elastic_ft.checkpoint.writer`): blobs first (each file cut into pieces
of at most :data:`~elastic_ft.train.token_files.PIECE_BYTES`, each with its size and sha256), then one
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

Not handled yet: a rank lost while building leaves the others waiting in the
next collective until it times out; the next world finds no manifest and builds
again from the start (the lost world's part blobs stay under ``parts/``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import time
import uuid

from elastic_ft.checkpoint.errors import ObjectNotFound
from elastic_ft.checkpoint.manifest import ManifestError, manifest_key
from elastic_ft.checkpoint.prefixed import PrefixedStore
from elastic_ft.checkpoint.reader import read_manifest
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointConflict, CheckpointWriter, Snapshot, retire
from elastic_ft.config import DataConfig
from elastic_ft.train import chat
from elastic_ft.train.datafiles import DataError, check_files
from elastic_ft.train.token_files import (
    StoreTorn, assemble, blob_name, local_reader, localize, locked, mark_verified, replace_dir, store_reader,
    upload_files,
)
from elastic_ft.train.token_identity import FileDigests, data_format, identity, token_settings, tokenizer_fingerprint
from elastic_ft.train.token_records import PART_FILES, Records, load_dataset, share, tokenize_share
from elastic_ft.train.token_store import FILES, TokenStore, token_dtype
from elastic_ft.train.world import World, broadcast_from_leader, gather_from_all

log = logging.getLogger(__name__)

STORE_PREFIX = "tokens/"


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
                refs = upload_files(writer, os.path.join(work, "part"), PART_FILES, f"parts/{nonce}/{world.rank:05d}/")
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
    readers = [local_reader(os.path.join(work, "part"))] + [store_reader(sub, refs) for _, refs in results[1:]]
    out = os.path.join(work, "store")
    assemble(readers, cfg, dtype, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, vocab,
             ident, out)
    prefix = f"blobs/000000000000-{uuid.uuid4().hex[:8]}/"
    uploaded = upload_files(writer, out, FILES, prefix)
    blobs = {blob_name(name, n): ref for name, refs in uploaded.items() for n, ref in enumerate(refs)}
    snap = Snapshot(step=0, cursor=0, tensors={}, documents={}, config_hash=ident, world={"size": world.size})
    try:
        manifest = writer.commit_manifest(snap, blobs)
    except CheckpointConflict:  # another job committed the same store first: its bytes are the same
        manifest = read_manifest(sub, manifest_key(0), run_id=writer.run_id)
    for _, refs in results[1:]:
        for ref in itertools.chain.from_iterable(refs.values()):
            sub.delete(ref.key)
    # The leader's node keeps the assembled files: they are the committed bytes (hashed as they went up).
    with locked(os.path.join(node_root, ident) + ".lock"):
        if manifest.writer == writer.writer_token:
            replace_dir(out, os.path.join(node_root, ident))
            mark_verified(os.path.join(node_root, ident), manifest)
    return manifest


def ensure(world: World, run_store: ObjectStore, run_id: str, cfg: DataConfig, tokenizer, node_cache: str) -> tuple[TokenStore, Built]:
    """The run's token store for ``cfg`` and ``tokenizer``, mapped on this rank (built by the world if it
    is not committed yet). Called by every rank alike; ``cfg.files`` are local paths."""
    t0 = time.monotonic()
    node_root = os.path.join(node_cache, "tokens")
    fmt = data_format(cfg)
    extra = ""
    if cfg.dataset:
        extra = getattr(load_dataset(cfg, fmt), "_fingerprint", "") or ""
    digests = FileDigests(os.path.join(node_root, "files.json"))
    template = chat.template_text(tokenizer, cfg.messages_field) if cfg.messages_field else None
    ident = identity(token_settings(cfg, fmt, template), [digests.digest(p) for p in cfg.files],
                     tokenizer_fingerprint(tokenizer), extra)
    sub = PrefixedStore(run_store, f"{STORE_PREFIX}{ident}")
    built = False
    for attempt in (1, 2):
        manifest = broadcast_from_leader(world, _committed(sub, run_id) if world.is_leader else None)
        if manifest is None:
            if fmt in ("json", "text"):  # every unusable line named before any rank tokenizes
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


__all__ = ["Built", "STORE_PREFIX", "build", "ensure"]
