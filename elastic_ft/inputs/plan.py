"""Whether a cached copy may be reused, and whether a fetch fits its bounds (pure functions).

A cached file is reused only when the object's ETag and size, as S3 answers
them now, are those recorded when it was downloaded, and the file on disk has
the recorded size (and, checked by the cache, the recorded sha256). Anything
else fetches it again: a changed object, a truncated or damaged copy, a
record from an older version of the cache that cannot be read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

RECORD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RemoteObject:
    """One object to cache: its S3 ``key``, its path ``rel`` inside the cache entry, ETag and size."""

    key: str
    rel: str
    etag: str
    size: int


@dataclasses.dataclass(frozen=True)
class Record:
    """What was recorded when a file was downloaded: the object's ETag and size, and the file's sha256."""

    etag: str
    size: int
    sha256: str


def reuse_problem(remote: RemoteObject, record: Record | None, local_size: int | None) -> str | None:
    """Why the cached copy of ``remote`` cannot be reused, or None (then only its digest is left to check)."""
    if record is None:
        return "not cached yet"
    if local_size is None:
        return "the cached file is missing"
    if (record.etag, record.size) != (remote.etag, remote.size):
        return f"the object changed (ETag {record.etag} -> {remote.etag}, size {record.size} -> {remote.size})"
    if local_size != record.size:
        return f"the cached file has {local_size} bytes, not the {record.size} recorded"
    return None


def bounds_problem(objects: Iterable[RemoteObject], *, max_file_bytes: int, max_total_bytes: int) -> str | None:
    """Why ``objects`` are too large to fetch (naming the setting to raise), or None."""
    total = 0
    for obj in objects:
        if obj.size > max_file_bytes:
            return (f"{obj.key} has {obj.size} bytes, more than inputs.max_file_bytes ({max_file_bytes}); "
                    "raise it if this object is meant to be fetched")
        total += obj.size
    if total > max_total_bytes:
        return (f"the objects total {total} bytes, more than inputs.max_model_bytes ({max_total_bytes}); "
                "raise it if they are meant to be fetched")
    return None


def stale_files(local: Iterable[str], wanted: Iterable[str]) -> list[str]:
    """Cached files (relative paths) no longer under the prefix: removed, so a model directory is exactly its prefix."""
    return sorted(set(local) - set(wanted))


def records_from_json(doc: Any) -> dict[str, Record]:
    """The per-file records of a cache entry's record document; {} for one that cannot be read (fetch again)."""
    if not isinstance(doc, Mapping) or doc.get("version") != RECORD_VERSION:
        return {}
    files = doc.get("files")
    out: dict[str, Record] = {}
    for rel, r in (files.items() if isinstance(files, Mapping) else ()):
        try:
            out[str(rel)] = Record(etag=str(r["etag"]), size=int(r["size"]), sha256=str(r["sha256"]))
        except (KeyError, TypeError, ValueError):
            continue  # this file is fetched again
    return out


def records_to_json(uri: str, records: Mapping[str, Record]) -> dict:
    return {"version": RECORD_VERSION, "uri": uri,
            "files": {rel: dataclasses.asdict(r) for rel, r in sorted(records.items())}}


__all__ = ["RECORD_VERSION", "Record", "RemoteObject", "bounds_problem", "records_from_json", "records_to_json",
           "reuse_problem", "stale_files"]
