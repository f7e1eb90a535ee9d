"""``s3://bucket/prefix`` URIs: the scheme registry's checker for ``s3://``."""

from __future__ import annotations

import urllib.parse

from elastic_ft.checkpoint.errors import StoreError


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into ``("bucket", "some/prefix/")``.

    The prefix is empty or ends with one '/', so keys join without doubling it.
    Raises :class:`StoreError` for another scheme, no bucket, a query or
    fragment, or an empty path segment ('//', which would name another key).
    """
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme.lower() != "s3":
        raise StoreError(f"{uri!r} is not an S3 URI; write it as s3://bucket/prefix")
    if not parsed.netloc:
        raise StoreError(f"S3 URI {uri!r} names no bucket; write it as s3://bucket/prefix")
    if parsed.query or parsed.fragment:
        raise StoreError(f"S3 URI {uri!r} has a query or fragment; write it as s3://bucket/prefix")
    prefix = parsed.path.strip("/")
    if "//" in parsed.path.rstrip("/"):
        raise StoreError(f"S3 URI {uri!r} has an empty path segment ('//'); remove it")
    return parsed.netloc, (prefix + "/" if prefix else "")


__all__ = ["parse_s3_uri"]
