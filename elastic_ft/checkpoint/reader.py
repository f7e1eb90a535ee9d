"""Loading checkpoints: list committed manifests, verify every blob, fall back.

Only manifests count: blobs without one are invisible. The newest manifest
whose blobs all verify (size and sha256) is loaded. Each checkpoint read ends
in an outcome (:mod:`elastic_ft.checkpoint.choice` decides from them): a
corrupt one (altered blob, a safetensors header that does not describe its
data, torn manifest, a blob a listing proves missing)
makes the load fall back to the previous manifest, and each skip is reported
with its reason. A foreign manifest (another run, another format version)
raises, because the URI points somewhere wrong and guessing could resume the
wrong model; so does a checkpoint the store could not serve
(:class:`StoreUnavailable`), because nothing is known about it.

A sharded checkpoint (:mod:`elastic_ft.checkpoint.sharded`) is verified the
same way, blob by blob, and its DCP metadata decoded and checked, but its
tensors are not decoded here: they load into the current world's shards
with :func:`elastic_ft.checkpoint.sharded.load_sharded` (``tensors`` is ``{}``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from elastic_ft.checkpoint.choice import CORRUPT, FOREIGN, OK, Outcome, choose, classify, need_more
from elastic_ft.checkpoint.dcp_metadata import METADATA_BLOB, SHARDED_PREFIX, verify_metadata
from elastic_ft.checkpoint.manifest import (
    MANIFEST_PREFIX, BlobRef, Manifest, ManifestForeign, check_manifest_size, parse_manifest, step_of_key,
)
from elastic_ft.checkpoint.safetensors_header import decode_header
from elastic_ft.checkpoint.store import ObjectInfo, ObjectNotFound, ObjectStore, StoreError, StoreUnavailable

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedCheckpoint:
    manifest: Manifest
    tensors: dict[str, dict[str, torch.Tensor]]
    documents: dict[str, Any]


Skipped = Outcome
"""A checkpoint passed over on the way to the one loaded (a corrupt :class:`Outcome`)."""


class BlobNotFound(ObjectNotFound):
    """A manifest's blob answered "not found"; ``key`` is the blob (a listing decides if it is really gone)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self):
        # Sharded loads gather each rank's error to the others (pickled in
        # memory, never from storage); the default would drop ``key``.
        return _blob_not_found, (str(self), self.key)


def _blob_not_found(message: str, key: str) -> BlobNotFound:
    return BlobNotFound(message, key=key)


def list_manifests(store: ObjectStore) -> list[ObjectInfo]:
    """Committed manifest objects, oldest step first."""
    found = [o for o in store.list(MANIFEST_PREFIX) if step_of_key(o.key) is not None]
    return sorted(found, key=lambda o: step_of_key(o.key))


def read_manifest(store: ObjectStore, key: str, *, run_id: str | None = None, size: int | None = None) -> Manifest:
    """Fetch and parse one manifest; ``size`` (from a listing) refuses an oversized one before downloading it."""
    if size is not None:
        check_manifest_size(size, key=key)
    return parse_manifest(store.get(key), key=key, expected_run_id=run_id)


_IN_FLIGHT = 2


def fetch_verified(store: ObjectStore, ref: BlobRef) -> bytes | memoryview:
    try:
        return store.get_verified(ref.key, size=ref.size, sha256=ref.sha256, chunk_size=ref.chunk_size)
    except BlobNotFound:
        raise
    except ObjectNotFound as exc:
        raise BlobNotFound(str(exc), key=ref.key) from exc


def confirmed_absent(store: ObjectStore, key: str) -> tuple[bool, str]:
    """Whether a listing that succeeded shows ``key`` absent, with a note for the reason.

    A failed listing proves nothing: (False, why it failed).
    """
    try:
        listed = store.list(key)
    except (StoreError, OSError) as exc:
        return False, f"; listing it to confirm failed too: {exc}"
    if any(o.key == key for o in listed):
        return False, "; yet a listing shows it, so the store is not answering consistently"
    return True, "; a listing confirms it is absent"


def _outcome_of(store: ObjectStore, step: int, key: str, exc: BaseException) -> Outcome:
    """Classify ``exc`` (raised reading the checkpoint at ``step``); re-raises what says nothing about the data."""
    absent, note = False, ""
    if isinstance(exc, BlobNotFound):
        absent, note = confirmed_absent(store, exc.key)
    kind = classify(exc, blob_absent=absent)
    if kind is None:
        raise exc
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, StoreError) and not isinstance(exc, ValueError):
        text = f"{type(exc).__name__}: {text}"  # an OSError's class names the fault (IsADirectoryError, ...)
    return Outcome(step, key, text + note, kind)


def probe(store: ObjectStore, info: ObjectInfo, run_id: str | None) -> tuple[Outcome, LoadedCheckpoint | None]:
    """Read and verify the checkpoint whose manifest ``info`` lists: its outcome, and the checkpoint if ok."""
    step = step_of_key(info.key)
    assert step is not None
    try:
        loaded = load_blobs(store, read_manifest(store, info.key, run_id=run_id, size=info.size))
    except Exception as exc:  # classified below; anything that says nothing about the data is re-raised
        return _outcome_of(store, step, info.key, exc), None
    return Outcome(step, info.key, "verified", OK), loaded


def load_blobs(store: ObjectStore, manifest: Manifest) -> LoadedCheckpoint:
    """Fetch and verify every blob of ``manifest``; raises :class:`StoreError` naming the first bad one."""
    # Imported here, not above: only a load makes tensors, and listing, reading manifests and verifying
    # (the read-only CLI commands) must not pay torch's import (~3.5 s of CPU).
    from elastic_ft.checkpoint.codec import tensors_from_safetensors

    tensors: dict[str, dict[str, torch.Tensor]] = {}
    documents: dict[str, Any] = {}
    refs = iter(sorted(manifest.blobs.items()))
    # Two blobs in flight: the next downloads (its parts in parallel, in the
    # store) while this one is parsed. More did not load faster (1 GB on
    # SeaweedFS, bench/checkpoint.py): the parts already fill the store's pool.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_IN_FLIGHT, thread_name_prefix="ckpt-load") as pool:
        pending: collections.deque = collections.deque()

        def fetch_next() -> None:
            item = next(refs, None)
            if item is not None:
                ref = item[1]
                pending.append((item, pool.submit(fetch_verified, store, ref)))

        for _ in range(_IN_FLIGHT):
            fetch_next()
        try:
            while pending:
                (name, ref), fetch = pending.popleft()
                data = fetch.result()
                group = name.split("/", 1)[0]  # "model/00001-of-00004": one shard of group "model"
                if name == METADATA_BLOB:  # decoded and checked, the tensors it describes are not
                    verify_metadata(data, manifest.blobs, key=ref.key)
                elif name.startswith(SHARDED_PREFIX):
                    pass  # a rank's sharded data: its digest was verified, which is all a probe needs
                elif ref.key.endswith(".safetensors"):
                    tensors.setdefault(group, {}).update(tensors_from_safetensors(data, key=ref.key))
                else:
                    documents[group] = json.loads(bytes(data))
                del data
                fetch_next()
        except BaseException:
            for _, f in pending:
                f.cancel()
            raise
    return LoadedCheckpoint(manifest, tensors, documents)


def verify(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Re-hash every blob and check each safetensors header; the problems that prove it corrupt (empty: all verify).

    Raises :class:`StoreUnavailable` naming the blob when one could not be read
    (no conclusion about it can be drawn).
    """
    problems = []
    for name, ref in sorted(manifest.blobs.items()):
        try:
            data = fetch_verified(store, ref)
            if ref.key.endswith(".safetensors"):
                decode_header(data, key=ref.key)  # a digest proves only that these are the bytes written
            elif name == METADATA_BLOB:
                verify_metadata(data, manifest.blobs, key=ref.key)
        except Exception as exc:
            outcome = _outcome_of(store, manifest.step, manifest.key, exc)
            if outcome.kind != CORRUPT:
                raise StoreUnavailable(f"blob {name!r} of the checkpoint at step {manifest.step} could not be "
                                       f"read, so it was not verified: {outcome.reason}") from exc
            problems.append(f"{name}: {outcome.reason}")
    return problems


def load_newest(store: ObjectStore, run_id: str | None, *, max_step: int | None = None,
                ) -> tuple[LoadedCheckpoint | None, list[Skipped]]:
    """The newest committed checkpoint whose blobs verify, and the corrupt ones skipped on the way.

    ``max_step`` restricts the choice (export of a given step). Nothing is
    retired here (callers decide). Raises :class:`ManifestForeign` for a
    foreign manifest and :class:`StoreUnavailable` for a checkpoint that could
    not be read (:func:`elastic_ft.checkpoint.choice.choose`), each naming the
    step and the object.
    """
    outcomes: list[Outcome] = []
    loaded = None
    for info in reversed(list_manifests(store)):
        step = step_of_key(info.key)
        if max_step is not None and step is not None and step > max_step:
            continue
        outcome, loaded = probe(store, info, run_id)
        outcomes.append(outcome)
        if outcome.kind == CORRUPT:
            log.warning("checkpoint at step %d is corrupt and was skipped: %s", step, outcome.reason)
        if not need_more(outcomes):
            break
    choice = choose(outcomes)
    if choice.stop is not None:
        raise (ManifestForeign if choice.stop.kind == FOREIGN else StoreUnavailable)(choice.reason)
    return (loaded if choice.load is not None else None), list(choice.retire)
