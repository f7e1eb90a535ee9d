"""The job spec's ``inputs`` section: where a node caches fetched inputs, and how large they may be.

The section only bounds and places the cache; how S3 is reached (endpoint,
region, retries, timeouts, and the ranged GETs of a large object:
``download_part_size`` and ``max_concurrency``) is the ``checkpoint.s3``
section's, shared by the inputs, and credentials come from boto3's chain as
for checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Literal

#: The cache directory when ``inputs.cache_dir`` is null.
ENV_CACHE_DIR = "ELASTIC_FT_INPUT_CACHE"

GiB = 1 << 30


@dataclasses.dataclass(kw_only=True)
class InputsConfig:
    cache_dir: str | None = None
    """Node-local directory of fetched ``s3://`` inputs, shared by every worker of the node and kept across
    restarts and retried jobs. Null: ``$ELASTIC_FT_INPUT_CACHE``, else ``$XDG_CACHE_HOME/elastic_ft/inputs``
    (``~/.cache/elastic_ft/inputs``). Not part of the config hash."""
    max_file_bytes: int = 64 * GiB
    """Largest single object fetched (a data file, or one file of a model directory); 1 B to 5 TiB."""
    max_model_bytes: int = 1024 * GiB
    """Largest total of the objects under a model (or tokenizer) prefix; 1 B to 16 TiB."""
    max_model_files: int = 10_000
    """Most objects under a model (or tokenizer) prefix (1 to 1000000); listing stops past it."""
    lock_timeout_s: float = 3600.0
    """Longest a worker waits for the lock of a cache entry that another process holds while it fetches
    that input (the local ranks of a node share the cache: one downloads, the others wait); 1 s to 1 day.
    Longer than the largest input takes to download. A holder that died on a shared filesystem holds it
    until then: the error names the holder's host and pid."""
    verify: Literal["sha256", "size"] = "sha256"
    """How a cached copy is checked before reuse, besides its remote ETag and size: its digest against the
    one taken while it downloaded, read from the file again only when the file's stat stamp (size, mtime,
    ctime, inode, device) is not the one recorded with that digest (so a restart costs a few stats), or its
    size only."""


def cache_root(settings: InputsConfig, environ: Mapping[str, str] | None = None) -> str:
    """The cache directory: the setting, else the environment variable, else the XDG cache directory."""
    environ = os.environ if environ is None else environ
    chosen = settings.cache_dir or environ.get(ENV_CACHE_DIR)
    if not chosen:
        base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "elastic_ft", "inputs")
    return os.path.abspath(os.path.expanduser(chosen))


__all__ = ["ENV_CACHE_DIR", "InputsConfig", "cache_root"]
