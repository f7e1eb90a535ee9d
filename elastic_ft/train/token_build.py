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

1. Every rank computes the identity (and all must agree: a node that sees other
   data stops the world with one line). A data file's digest is read from the
   node's record of (path, size, mtime, inode) -> sha256, so a restart reads no
   data file; a file whose stat changed is hashed again. A ``data.dataset`` that
   is a local directory is named by its files' contents the same way; a hub
   dataset by the fingerprint ``datasets`` gives it, loaded by the leader alone
   and shared, so the other ranks of a restart do not load the dataset.
2. The leader reads the manifest and tells the others. None: the world builds
   it. Each rank tokenizes a contiguous share of the records, streamed (no rank
   holds more than a batch of records as Python objects), into part files; the
   other ranks upload theirs; the leader concatenates the parts in rank order
   into the final files (byte-identical whatever the world's size), uploads
   them and commits the manifest, then deletes every part and blob under the
   identity that the manifest does not name (:func:`_remove_orphans`).
3. Each node maps its copy under ``<node cache>/tokens/<identity>/``: fetched
   piece by piece (memory: one piece) and verified, once (a fetch cut short
   keeps its whole pieces for the next start on the node); a later start on the
   node trusts the copy while its files keep the stat stamp they had when they
   were hashed (below). A blob of the run's store whose bytes do not match
   its manifest (torn, altered) is never used: the manifest is retired to
   ``quarantine/`` and the store is built again.

Failures. Every step that a rank may fail alone (reading the manifest,
tokenizing, uploading a part, assembling and committing, copying to the node)
ends in one exchange where each rank reports how it went (:func:`~elastic_ft.train.token_exchange.together`):
the rank that failed raises its own error, every other rank
:class:`~elastic_ft.train.world.RunAborted` naming that rank and its error in
one line. No rank waits in a later collective for one that gave up. The
exchanges after the hub fingerprint go through a gloo group made for them
(:func:`~elastic_ft.train.token_exchange.exchange_group`) whose timeout is the collective timeout plus the
dataset-sized work at a conservative 20 MB/s (:func:`~elastic_ft.train.token_exchange.exchange_timeout`,
capped at a day): the leader's assembly and upload, and each node's fetch and
hash, happen while the other ranks wait there, and at tens of GB a fixed
600 s would cut every world's build short. A rank that dies instead (a lost
machine, SIGKILL) is waited for at most that timeout, and torchrun or the
rendezvous restarts the world first. (Loading a hub dataset for its
fingerprint, on the leader, is still bounded by the collective timeout: its
size is known only once loaded.) Nothing is used before its manifest: a rank
maps only a committed store, and the leader's node gets the assembled files
only once the manifest is written. The next world finds no manifest and builds the store again from
the start (a share depends on the world's size, so a lost world's parts are
not resumed: a build is one tokenization pass, short next to the restarts it
saves); its commit removes what the lost world uploaded, and each node's
lost work directories are swept once no live process holds their lock
(:func:`~elastic_ft.train.token_workdirs.sweep_scratch`).

Trusting the node copy by its stat. The stamp is each file's size, mtime,
ctime, inode and device, plus the digest of the manifest it was checked
against, taken before the files were hashed. Any write through the file
system moves mtime and ctime; putting mtime back (``touch -d``, ``cp -p``,
``utime``) moves ctime, which no process can set; a replaced file has another
inode. So a copy changed by anything on the node is hashed again before use.
What a stamp cannot see is corruption below the file system (a failing disk's
silent bit flips): that keeps every stamp, and catching it would mean hashing
the whole store at each start, a cost that grows with the dataset at every
restart. Checksumming file systems, or the ECC of the disk, are that layer's
guard; a copy is also hashed again whenever the manifest changes.

Cost: a start with a committed store and a node copy: one manifest read, a
few stats and one gloo group made and destroyed, nothing that grows with the
dataset. A node without a copy: one
download of the store (about 3 bytes per token), hashed once. A build: one
tokenization pass over the data, shared by the ranks, plus each part's upload
and the leader's concatenation (one pass over the tokens).

Why a format of our own, not ``datasets.map``. Measured by ``bench/data.py``
(the figures of one run are in the README, "Data is tokenized once per run"):
``load_dataset`` to Arrow then ``map(num_proc=2)`` to Arrow cache files, doing
the same tokenization (:func:`~elastic_ft.train.token_records.encode`), costs
about the CPU of the store's 1-process build (the map's time goes to turning
each batch's Python lists of ids into Arrow lists and writing the shards).
Its cache is a third larger than the store (int32 ids against the smallest
unsigned id type plus a byte of trained mark per token), and a restart from
it is slower and about 100 MB larger in RSS than one from the store. Beyond the figures, the
``datasets`` cache is per node and named by a fingerprint of the map
function, not of the data's bytes: nothing commits it to the run's location
or verifies it when another node takes it, and its ``num_proc`` splits work
within one node, not across the world's ranks. So the store keeps its own
format; ``datasets`` reads what is not JSON Lines (parquet, text, a dataset
name or a saved directory), memory-mapped, feeding the same shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
import uuid

from elastic_ft.checkpoint.errors import ObjectNotFound, StoreError
from elastic_ft.checkpoint.manifest import ManifestCorrupt, ManifestForeign, manifest_key
from elastic_ft.checkpoint.prefixed import PrefixedStore
from elastic_ft.checkpoint.reader import read_manifest
from elastic_ft.checkpoint.store import ObjectStore
from elastic_ft.checkpoint.writer import CheckpointConflict, CheckpointWriter, Snapshot, retire
from elastic_ft.config import DataConfig
from elastic_ft.train import chat
from elastic_ft.train.datafiles import DataError, check_files
from elastic_ft.train.faults import Injector
from elastic_ft.train.token_exchange import exchange_group, together
from elastic_ft.train.token_files import (
    StoreTorn, assemble, blob_name, blobs_digest, content_digest, install, local_reader, localize, store_reader, upload_files,
)
from elastic_ft.train.token_identity import FileDigests, data_format, identity, token_settings, tokenizer_fingerprint
from elastic_ft.train.token_records import PART_FILES, Records, dataset_files, load_dataset, share, tokenize_share
from elastic_ft.train.token_store import FILES, TokenStore, token_dtype
from elastic_ft.train.token_workdirs import locked, scratch, sweep_scratch
from elastic_ft.train.world import RunAborted, World, broadcast_from_leader

log = logging.getLogger(__name__)

STORE_PREFIX = "tokens/"


@dataclasses.dataclass
class Built:
    """What :func:`ensure` did, for events and the bench."""

    identity: str
    built: bool
    seconds: float


def _read(sub: ObjectStore, run_id: str):
    """The committed store's manifest (:class:`ObjectNotFound` if none). One of another run or format is a
    hard stop naming its key: the run's location holds what this run did not write, so nothing there is
    retired or rebuilt over (:class:`DataError`, one line)."""
    key = manifest_key(0)
    try:
        return read_manifest(sub, key, run_id=run_id)
    except ManifestForeign as exc:
        raise DataError(f"token store {sub.uri}/{key}: {' '.join(str(exc).split())}") from exc


def _committed(sub: ObjectStore, run_id: str):
    """The committed store's manifest, or None (absent, or corrupt: then it is retired and rebuilt)."""
    try:
        return _read(sub, run_id)
    except ObjectNotFound:
        return None
    except ManifestCorrupt as exc:  # only a broken manifest: a foreign one stopped in _read
        log.warning("token store: %s; building it again", exc)
        retire(sub, manifest_key(0), str(exc))
        return None


def build(world: World, sub: ObjectStore, run_id: str, cfg: DataConfig, fmt: str | None, tokenizer, ident: str,
          node_root: str, group=None):
    """Tokenize with every rank of ``world``, commit the store; the manifest on every rank.

    A failure on any rank (bad data, a store that refuses writes once its retries are spent) stops every
    rank with one line naming it (:func:`~elastic_ft.train.token_exchange.together`); nothing is committed then, and the next start builds
    again. Part blobs of builds that never committed are removed by the build that commits
    (:func:`_remove_orphans`). The exchanges go through ``group`` (:func:`~elastic_ft.train.token_exchange.exchange_group`), whose timeout
    allows for the data's size.
    """
    writer = CheckpointWriter(sub, run_id)
    # One name for the build's parts, the leader's: a failed build's parts are found under it.
    nonce = broadcast_from_leader(world, uuid.uuid4().hex[:12], group)
    faults = Injector.from_env()
    with contextlib.ExitStack() as held:
        got: dict = {}

        def tokenize():
            # Everything a rank may fail alone is in this exchanged step: the vocabulary's type, the node's
            # disk (a full or unwritable node cache), the data and the store.
            got["vocab"] = max(len(tokenizer), getattr(tokenizer, "vocab_size", 0) or 0)
            got["dtype"] = token_dtype(got["vocab"])
            sweep_scratch(node_root)  # what the ranks of a lost build left on this node
            got["work"] = work = held.enter_context(scratch(node_root, f".build-{nonce}-{world.rank}"))
            records = Records(cfg, fmt)
            lo, hi = share(records.count, world.rank, world.size)
            tokenize_share(records, lo, hi, cfg, tokenizer, got["dtype"], os.path.join(work, "part"))
            faults.maybe_kill_build(rank=world.rank, point="share")
            if world.is_leader:
                return None
            return upload_files(writer, os.path.join(work, "part"), PART_FILES, f"parts/{nonce}/{world.rank:05d}/")

        parts = together(world, "build (tokenizing the shares)", tokenize, group=group)
        return together(world, "build (assembling and committing)", lambda: _assemble_and_commit(
            world, sub, writer, parts, cfg, got["dtype"], tokenizer, got["vocab"], ident, got["work"], node_root,
            faults), leader_only=True, group=group)


def _assemble_and_commit(world, sub, writer, parts, cfg, dtype, tokenizer, vocab, ident, work, node_root, faults):
    readers = [local_reader(os.path.join(work, "part"))] + [store_reader(sub, refs) for refs in parts[1:]]
    out = os.path.join(work, "store")
    assemble(readers, cfg, dtype, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, vocab,
             ident, out)
    prefix = f"blobs/000000000000-{uuid.uuid4().hex[:8]}/"
    uploaded = upload_files(writer, out, FILES, prefix)
    blobs = {blob_name(name, n): ref for name, refs in uploaded.items() for n, ref in enumerate(refs)}
    snap = Snapshot(step=0, cursor=0, tensors={}, documents={}, config_hash=ident, world={"size": world.size})
    faults.maybe_kill_build(rank=world.rank, point="commit")
    try:
        manifest = writer.commit_manifest(snap, blobs)
    except CheckpointConflict:
        # Another writer of this run (a duplicate job, a world that outlived its successor's start)
        # committed the store first. The store is content-addressed (its identity names the data, tokenizer
        # and settings), so that store is this one: adopted, and verified like any committed store when a
        # node copies it. A manifest of another run there is a hard stop (_read), never adopted.
        manifest = _read(sub, writer.run_id)
    _remove_orphans(sub, manifest)
    # The leader's node keeps the assembled files when they are the committed bytes (hashed as they went
    # up): ours, or another writer's of the same content. A copy already verified as those bytes (another
    # run on this node with the same data) is kept, not replaced under whoever maps it.
    if content_digest(manifest) == blobs_digest(blobs):
        with locked(os.path.join(node_root, ident) + ".lock"):
            install(out, os.path.join(node_root, ident), manifest)
    return manifest


def _remove_orphans(sub: ObjectStore, manifest) -> None:
    """Delete the parts and blobs under this store's prefix that ``manifest`` (just committed) does not name.

    Why only here: once the manifest is committed, no build of this identity will ever read a part or an
    unnamed blob again (a later world maps the committed store; a rebuild after a torn store writes new
    blobs under a new prefix), so what a build lost before its commit (a rank killed, a store error) is
    garbage. Never a committed store's blob: every key the manifest names is kept. Never because of a
    transient fault: nothing is deleted unless a commit succeeded, and a delete that fails is logged and
    left for the next build of the identity (the parts cost storage, never correctness).
    """
    named = {ref.key for ref in manifest.blobs.values()}
    try:
        keys = [o.key for prefix in ("parts/", "blobs/") for o in sub.list(prefix)]
        orphans = [k for k in keys if k not in named]
        for key in orphans:
            sub.delete(key)
    except (StoreError, OSError) as exc:
        log.warning("token store: could not remove the parts of builds that never committed under %s: %s",
                    sub.uri, exc)
        return
    if orphans:
        log.info("token store: removed %d blob(s) of builds that never committed under %s", len(orphans), sub.uri)


def _node_copy(sub: ObjectStore, manifest, node_root: str, ident: str) -> tuple[str | None, str | None]:
    """(None, the node copy's directory), or (why the run's store is torn, None)."""
    try:
        return None, localize(sub, manifest, node_root, ident)
    except StoreTorn as exc:
        return str(exc), None


def _hub_fingerprint(cfg: DataConfig, fmt: str | None) -> tuple[str, int]:
    """The fingerprint ``datasets`` gives a hub ``data.dataset`` and its size in bytes (Arrow); ("", 0) for a
    local directory with files: those name it."""
    if dataset_files(cfg):
        return "", 0
    loaded = load_dataset(cfg, fmt)
    return getattr(loaded, "_fingerprint", "") or "", int(getattr(getattr(loaded, "data", None), "nbytes", 0) or 0)


def _input_bytes(cfg: DataConfig) -> int:
    """The size of the local data files (``data.files``, a local ``data.dataset``'s files): a few stats."""
    total = 0
    for path in [*cfg.files, *dataset_files(cfg)]:
        try:
            total += os.path.getsize(path)
        except OSError:  # reported by the exchanged steps that read it
            pass
    return total


def ensure(world: World, run_store: ObjectStore, run_id: str, cfg: DataConfig, tokenizer, node_cache: str) -> tuple[TokenStore, Built]:
    """The run's token store for ``cfg`` and ``tokenizer``, mapped on this rank (built by the world if it
    is not committed yet). Called by every rank alike; ``cfg.files`` are local paths."""
    t0 = time.monotonic()
    node_root = os.path.join(node_cache, "tokens")
    fmt = together(world, "data check", lambda: data_format(cfg))[world.rank]  # a file missing on one node

    # A hub dataset is named by the fingerprint `datasets` gives what it loaded: the leader loads it (at
    # every start: the fingerprint follows the hub's revision) and tells the others, so the other ranks of a
    # restart with a committed store never load the dataset (a ``data.dataset`` that is a local directory is
    # named by its files' contents on every rank, below). Every rank takes this step when data.dataset is set
    # (the same config on all), whatever its disk shows.
    hub, hub_bytes = together(world, "hub dataset's fingerprint", lambda: _hub_fingerprint(cfg, fmt),
                               leader_only=True) if cfg.dataset else ("", 0)
    # The leader's size: every rank's group gets the same timeout (a node with other files stops below).
    input_bytes = broadcast_from_leader(world, _input_bytes(cfg) + hub_bytes if world.is_leader else None)
    with exchange_group(world, input_bytes) as group:
        return _ensure(world, run_store, run_id, cfg, tokenizer, node_root, fmt, hub, group, t0)


def _ensure(world, run_store, run_id, cfg, tokenizer, node_root, fmt, hub, group, t0):

    def name() -> str:
        template = chat.template_text(tokenizer, cfg.messages_field) if cfg.messages_field else None
        digests = FileDigests(os.path.join(node_root, "files.json"))
        extra = ""
        local = dataset_files(cfg)
        if local:  # a local dataset directory: named by its files' contents (each hashed once per node)
            extra = json.dumps([[os.path.relpath(p, cfg.dataset), digests.digest(p)] for p in local])
        elif cfg.dataset:
            extra = hub
        return identity(token_settings(cfg, fmt, template), [digests.digest(p) for p in cfg.files],
                        tokenizer_fingerprint(tokenizer), extra)

    names = together(world, "identity", name, group=group)
    ident = names[world.rank]
    if any(n != names[0] for n in names):  # a node whose data files differ would build or map another store
        other = next(r for r, n in enumerate(names) if n != names[0])
        raise RunAborted(f"rank {other} sees other data than rank 0 (token store {names[other][:12]}, not "
                         f"{names[0][:12]}): give every node the same data.files and tokenizer")
    sub = PrefixedStore(run_store, f"{STORE_PREFIX}{ident}")
    built = False
    for attempt in (1, 2):
        manifest = together(world, "manifest read", lambda: _committed(sub, run_id), leader_only=True, group=group)
        if manifest is None:
            if fmt in ("json", "text"):  # every unusable line named before any rank tokenizes
                together(world, "data check", lambda: check_files(cfg, fmt), group=group)
            manifest, built = build(world, sub, run_id, cfg, fmt, tokenizer, ident, node_root, group), True
        results = together(world, "copy to the node", functools.partial(_node_copy, sub, manifest, node_root, ident),
                            group=group)
        problems = [p for p, _ in results if p]
        directory = results[world.rank][1]
        if not problems:
            break
        log.warning("token store: %s; it is not used, and is built again", problems[0])
        # The retirement is done before anyone reads again.
        together(world, "retirement of a torn store", lambda: retire(sub, manifest_key(0), problems[0]),
                  leader_only=True, group=group)
    else:
        raise DataError(f"the token store {sub.uri} was torn again after it was rebuilt: {problems[0]}; "
                        f"check the checkpoint location's storage")
    store = TokenStore(directory)
    if store.header.identity != ident:
        raise DataError(f"token store {directory} holds {store.header.identity}, not {ident}")
    return store, Built(ident, built, time.monotonic() - t0)


__all__ = ["Built", "STORE_PREFIX", "build", "ensure"]
