"""Whether a cached copy may be reused, and whether a fetch fits its bounds (pure functions).

A cached file is reused only when the object's ETag and size, as S3 answers
them now, are those recorded when it was downloaded, and the file on disk has
the recorded size and (checked by the cache) the recorded digest. The digest
is read from the file again only when the file's stat stamp (size, mtime,
ctime, inode, device: :mod:`elastic_ft.checkpoint.stamp`) is not the one
recorded with it (:func:`digest_needed`): a restart on a node that holds a
16 GB model costs a few stats, not a pass over 16 GB. Anything else fetches it
again: a changed object, a truncated or damaged copy, a record that cannot be
read. Records of the first format (a plain sha256, no stamp) are still read:
their files are hashed once, then stamped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

RECORD_VERSION = 2
"""2: a chunked digest (``chunk_size``) and the file's stamp; 1 (still read): a plain sha256, no stamp."""


@dataclasses.dataclass(frozen=True)
class RemoteObject:
    """One object to cache: its S3 ``key``, its path ``rel`` inside the cache entry, ETag and size."""

    key: str
    rel: str
    etag: str
    size: int


@dataclasses.dataclass(frozen=True)
class Record:
    """What was recorded when a file was downloaded: the object's ETag and size, the file's digest
    (:func:`~elastic_ft.checkpoint.digest.blob_sha256` with chunks of ``chunk_size``; 0: a plain sha256),
    and the file's stat stamp when that digest was known to hold (None: never stamped)."""

    etag: str
    size: int
    sha256: str
    chunk_size: int = 0
    stamp: tuple[int, ...] | None = None


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


def digest_needed(record: Record, stamp: list[int] | tuple[int, ...] | None) -> bool:
    """Whether the cached file must be hashed again to be trusted: its stamp now (None: unreadable)
    is not the one recorded with its digest."""
    return stamp is None or record.stamp is None or tuple(record.stamp) != tuple(stamp)


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
    if not isinstance(doc, Mapping) or doc.get("version") not in (1, RECORD_VERSION):
        return {}
    files = doc.get("files")
    out: dict[str, Record] = {}
    for rel, r in (files.items() if isinstance(files, Mapping) else ()):
        try:
            stamp = r.get("stamp")
            out[str(rel)] = Record(etag=str(r["etag"]), size=int(r["size"]), sha256=str(r["sha256"]),
                                   chunk_size=int(r.get("chunk_size", 0)),
                                   stamp=tuple(int(v) for v in stamp) if isinstance(stamp, list) else None)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # this file is fetched again
        if out[str(rel)].chunk_size < 0:
            del out[str(rel)]
    return out


def records_to_json(uri: str, records: Mapping[str, Record]) -> dict:
    def doc(r: Record) -> dict:
        out = dataclasses.asdict(r)
        out["stamp"] = list(r.stamp) if r.stamp is not None else None
        return out

    return {"version": RECORD_VERSION, "uri": uri, "files": {rel: doc(r) for rel, r in sorted(records.items())}}


__all__ = ["RECORD_VERSION", "Record", "RemoteObject", "bounds_problem", "digest_needed", "records_from_json",
           "records_to_json", "reuse_problem", "stale_files"]
