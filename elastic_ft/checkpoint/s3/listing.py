"""Listing and deleting keys under the store's prefix."""

from __future__ import annotations

from typing import Any

from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.s3.errors import status
from elastic_ft.checkpoint.s3.target import S3Target
from elastic_ft.checkpoint.store import ObjectInfo


def list_objects(t: S3Target, prefix: str = "") -> list[ObjectInfo]:
    """Every object whose store key starts with ``prefix``, sorted by key (all pages, each retried)."""
    out: list[ObjectInfo] = []
    token: str | None = None
    full_prefix = t.prefix + prefix
    try:
        while True:
            args: dict[str, Any] = {"Bucket": t.bucket, "Prefix": full_prefix}
            if token:
                args["ContinuationToken"] = token
            page = t.retry("list", f"{prefix}*", lambda: t.client.list_objects_v2(**args))
            for obj in page.get("Contents", []):
                out.append(ObjectInfo(obj["Key"][len(t.prefix) :], int(obj["Size"]), obj["LastModified"].timestamp()))
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
    except StoreError:
        raise
    except Exception as exc:
        raise t.error("list", f"{prefix}*", exc) from exc
    # S3 already lists in UTF-8 byte order; sort anyway so every backend agrees.
    out.sort(key=lambda o: o.key)
    return out


def delete_object(t: S3Target, key: str) -> None:
    """Remove ``key``; a missing key is fine."""
    s3key = t.s3key(key)
    try:
        t.retry("delete", key, lambda: t.client.delete_object(Bucket=t.bucket, Key=s3key))
    except StoreError:
        raise
    except Exception as exc:
        if status(exc) == 404:
            return  # some S3-compatible servers answer 404 where S3 answers 204
        raise t.error("delete", key, exc) from exc


__all__ = ["delete_object", "list_objects"]
