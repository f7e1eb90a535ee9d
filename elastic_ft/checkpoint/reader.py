"""Loading checkpoints: list committed manifests, verify every blob, fall back.

Only manifests count: blobs without one are invisible. The newest manifest
whose blobs all verify (size and sha256) is loaded; a missing or altered blob
makes the load fall back to the previous manifest, and each skip is reported
with its reason. A foreign manifest (another run, another format version) is
not skipped silently: it raises, because it means the URI points somewhere
wrong, and guessing could resume the wrong model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from elastic_ft.checkpoint.manifest import MANIFEST_PREFIX, Manifest, parse_manifest, step_of_key
from elastic_ft.checkpoint.store import ObjectInfo, ObjectStore, StoreError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedCheckpoint:
    manifest: Manifest
    tensors: dict[str, dict[str, torch.Tensor]]
    documents: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Skipped:
    step: int
    key: str
    reason: str


def list_manifests(store: ObjectStore) -> list[ObjectInfo]:
    """Committed manifest objects, oldest step first."""
    found = [o for o in store.list(MANIFEST_PREFIX) if step_of_key(o.key) is not None]
    return sorted(found, key=lambda o: step_of_key(o.key))


def read_manifest(store: ObjectStore, key: str, *, run_id: str | None = None) -> Manifest:
    return parse_manifest(store.get(key), key=key, expected_run_id=run_id)


def load_blobs(store: ObjectStore, manifest: Manifest) -> LoadedCheckpoint:
    """Fetch and verify every blob of ``manifest``; raises :class:`StoreError` naming the first bad one."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    documents: dict[str, Any] = {}
    for name, ref in sorted(manifest.blobs.items()):
        data = store.get_verified(ref.key, size=ref.size, sha256=ref.sha256)
        group = name.split("/", 1)[0]  # "model/00001-of-00004": one shard of group "model"
        if ref.key.endswith(".safetensors"):
            tensors.setdefault(group, {}).update(load_safetensors(data))
        else:
            documents[group] = json.loads(data)
    return LoadedCheckpoint(manifest, tensors, documents)


def verify(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Re-hash every blob; the list of problems (empty when all verify)."""
    problems = []
    for name, ref in sorted(manifest.blobs.items()):
        try:
            store.get_verified(ref.key, size=ref.size, sha256=ref.sha256)
        except StoreError as exc:
            problems.append(f"{name}: {exc}")
    return problems


def load_newest(store: ObjectStore, run_id: str, *, max_step: int | None = None) -> tuple[LoadedCheckpoint | None, list[Skipped]]:
    """The newest committed checkpoint whose blobs verify, and what was skipped on the way.

    ``max_step`` restricts the choice (export of a given step). Raises
    :class:`~elastic_ft.checkpoint.manifest.ManifestError` for a foreign manifest.
    """
    skipped: list[Skipped] = []
    for info in reversed(list_manifests(store)):
        step = step_of_key(info.key)
        assert step is not None
        if max_step is not None and step > max_step:
            continue
        manifest = read_manifest(store, info.key, run_id=run_id)
        try:
            return load_blobs(store, manifest), skipped
        except StoreError as exc:
            reason = f"checkpoint at step {step} is unusable and was skipped: {exc}"
            log.warning(reason)
            skipped.append(Skipped(step, info.key, str(exc)))
    return None, skipped
