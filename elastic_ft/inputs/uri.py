"""The ``s3://`` URIs a spec may give for its inputs, and the keys they may name (pure functions).

A data file is one object, ``s3://bucket/key`` (no trailing '/'); a model or
tokenizer directory is every object under a prefix, ``s3://bucket/prefix/``
(the trailing '/' may be left out). Keys become paths in the node's cache, so
a key, or a key found under a listed prefix, must be '/'-separated names
without '', '.' or '..' (which would name another file, or leave the cache),
each at most 255 bytes (a file name's limit). '?' and '#' are refused as in
the checkpoint URI (write the URI without query or fragment).
"""

from __future__ import annotations

import dataclasses
import re

SCHEME = "s3://"
_BUCKET = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,253}[A-Za-z0-9])?$")
_MAX_KEY_BYTES = 1024  # S3's own limit
_MAX_NAME_BYTES = 255  # a file name's limit on Linux filesystems


class InputRefused(ValueError):
    """An input that will not be fetched (a malformed URI, a key that would leave the cache, a bound
    exceeded); ``str(exc)`` says why and what to do."""


@dataclasses.dataclass(frozen=True)
class S3Location:
    """An object (``key`` without a trailing '/') or a prefix (``key`` ending in '/') of ``bucket``."""

    bucket: str
    key: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def has_scheme(value: str) -> bool:
    """Whether ``value`` is written as a URI (``scheme://...``) rather than a path or hub name."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) is not None


def is_s3(value: str | None) -> bool:
    return value is not None and value[: len(SCHEME)].lower() == SCHEME


def key_problem(key: str) -> str | None:
    """Why ``key`` (an object key, or a key relative to a listed prefix) cannot be a cache path, or None."""
    if not key:
        return "the key is empty"
    if len(key.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
        return f"the key is longer than {_MAX_KEY_BYTES} bytes"
    if "\0" in key:
        return "the key holds a NUL character"
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "the key has an empty, '.' or '..' segment, which would leave its directory in the cache"
    if any(len(p.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES for p in parts):
        return f"a segment of the key is longer than {_MAX_NAME_BYTES} bytes, too long for a file name"
    return None


def _split(uri: str, example: str) -> tuple[str, str]:
    if not is_s3(uri):
        raise InputRefused(f"{uri!r} is not an s3:// URI; write it as {example} (or a local path)")
    rest = uri[len(SCHEME):]
    if "?" in rest or "#" in rest:
        raise InputRefused(f"{uri!r} has a query or fragment ('?' or '#'); write it as {example}")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise InputRefused(f"{uri!r} names no valid bucket (1 to 255 letters, digits, '.', '_', '-'); "
                            f"write it as {example}")
    return bucket, key


def parse_object_uri(uri: str) -> S3Location:
    """``s3://bucket/key`` as a location; :class:`InputRefused` naming what is wrong."""
    example = "s3://bucket/path/file.jsonl"
    bucket, key = _split(uri, example)
    if not key or key.endswith("/"):
        raise InputRefused(f"{uri!r} names a prefix, not a file; write it as {example}")
    problem = key_problem(key)
    if problem:
        raise InputRefused(f"{uri!r} cannot be fetched: {problem}; write it as {example}")
    return S3Location(bucket, key)


def parse_prefix_uri(uri: str) -> S3Location:
    """``s3://bucket/prefix/`` (trailing '/' optional) as a location whose key ends in '/'."""
    example = "s3://bucket/models/name/"
    bucket, key = _split(uri, example)
    key = key[:-1] if key.endswith("/") else key
    if not key:
        raise InputRefused(f"{uri!r} names a whole bucket; write the model's prefix, as {example}")
    problem = key_problem(key)
    if problem:
        raise InputRefused(f"{uri!r} cannot be fetched: {problem}; write it as {example}")
    return S3Location(bucket, key + "/")


def uri_problem(value: str, *, directory: bool) -> str | None:
    """Why the spec value ``value`` (a URI) cannot be fetched, or None; local paths and hub names are None."""
    if not has_scheme(value):
        return None
    if not is_s3(value):
        return f"{value!r}: only s3:// URIs are fetched; give an s3:// URI or a local path"
    try:
        (parse_prefix_uri if directory else parse_object_uri)(value)
    except InputRefused as exc:
        return str(exc)
    return None


__all__ = ["InputRefused", "S3Location", "has_scheme", "is_s3", "key_problem", "parse_object_uri",
           "parse_prefix_uri", "uri_problem"]
