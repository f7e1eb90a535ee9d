"""``s3://bucket/prefix`` URIs: the scheme registry's checker for ``s3://``."""

from __future__ import annotations

import re
import urllib.parse

from elastic_ft.checkpoint.errors import UnsupportedURI

_BUCKET = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,253}[A-Za-z0-9])?$")
"""S3's bucket names (and the older, wider us-east-1 ones: capitals, '_', up to 255), as the inputs' URIs."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into ``("bucket", "some/prefix/")``.

    The prefix is empty or ends with one '/', so keys join without doubling it.
    Raises :class:`UnsupportedURI` (a StoreError and a ValueError) for another scheme, no bucket or not a bucket
    name, a query or fragment, an empty path segment ('//', which would name
    another key), or a '.' or '..' segment: S3 keys are not paths, so
    ``s3://bucket/../x`` would go to the server as it is (which answered
    HTTP 400, reported as an endpoint problem) or name a key no path names.
    """
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme.lower() != "s3":
        raise UnsupportedURI(f"{uri!r} is not an S3 URI; write it as s3://bucket/prefix")
    if not parsed.netloc:
        raise UnsupportedURI(f"S3 URI {uri!r} names no bucket; write it as s3://bucket/prefix")
    if parsed.query or parsed.fragment:
        raise UnsupportedURI(f"S3 URI {uri!r} has a query or fragment; write it as s3://bucket/prefix")
    if not _BUCKET.match(parsed.netloc):
        raise UnsupportedURI(f"S3 URI {uri!r}: {parsed.netloc!r} is not a bucket name (letters, digits, '.', '_', "
                         f"'-', starting and ending with a letter or digit); write it as s3://bucket/prefix")
    prefix = parsed.path.strip("/")
    dots = next((seg for seg in prefix.split("/") if seg in (".", "..")), None)
    if dots is not None:
        raise UnsupportedURI(f"S3 URI {uri!r} has a {dots!r} path segment; S3 keys are not paths, so it would name "
                         f"no prefix you mean: write the prefix without it")
    if "//" in parsed.path.rstrip("/"):
        raise UnsupportedURI(f"S3 URI {uri!r} has an empty path segment ('//'); remove it")
    return parsed.netloc, (prefix + "/" if prefix else "")


__all__ = ["parse_s3_uri"]
