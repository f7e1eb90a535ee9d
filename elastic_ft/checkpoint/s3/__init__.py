"""The ``s3://bucket/prefix`` object store: boto3 behind the narrow ``ObjectStore`` interface.

What this adds over a plain ``put_object``/``get_object``, and where it lives:

- :mod:`.upload`: conditional create (``If-None-Match: *``, a 412 is
  :class:`ObjectExists`) and parallel multipart upload at
  ``multipart_threshold`` bytes and above, aborted if a part finally fails.
- :mod:`.download`: parallel ranged GETs into one buffer, pinned to one ETag,
  the size checked before anything of a manifest's claimed size is
  allocated, hashed while they land; :mod:`.body` reads each body straight
  from the socket into its slice.
- :mod:`.listing`: list and delete under the prefix.
- :mod:`.retry`: one tenacity policy for every request (bounded exponential
  backoff with jitter, each retry logged at WARNING, a final
  :class:`StoreUnavailable` stating the count); botocore's own retries are off.
- :mod:`.errors`: what is transient, and the store error for everything else:
  a 404 is :class:`ObjectNotFound`, a consistent wrong size or digest
  :class:`BlobMismatch`, anything else that stops a request (retries run out,
  AccessDenied/403, expired or missing credentials, no such bucket, an error
  nobody classified) :class:`StoreUnavailable`: the store could not answer,
  and callers must not conclude anything about the object.
- :mod:`.options`: every setting in one frozen dataclass, :class:`S3Options`
  (endpoint, region, server-side encryption, part sizes,
  concurrency, retry budget, timeouts): explicit settings (the job spec's
  ``checkpoint.s3`` section) win over the environment
  (``ELASTIC_FT_S3_SSE``, ``ELASTIC_FT_S3_SSE_KMS_KEY_ID``), which wins over
  the defaults. Credentials always come from boto3's chain.
- :mod:`.client`: the boto3 client a store builds for itself;
  :mod:`.target`: the bucket, prefix, client and pool every request shares;
  :mod:`.uri`: ``s3://`` URIs; :mod:`.store`: :class:`S3Store`, composed of them.

The scheme registry (:mod:`elastic_ft.checkpoint.store`) opens ``s3://`` URIs
with :meth:`S3Store.from_uri`; nothing here is imported until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first access (PEP 562), so that the job spec can use
# :class:`S3Options` without loading the store, its HTTP stack and boto3.
_EXPORTS = {
    "ENV_SSE": "options",
    "ENV_SSE_KMS_KEY_ID": "options",
    "S3Options": "options",
    "default_concurrency": "options",
    "S3Store": "store",
    "is_transient": "errors",
    "parse_s3_uri": "uri",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_EXPORTS)
