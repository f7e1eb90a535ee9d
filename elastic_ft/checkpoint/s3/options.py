"""Every setting of the S3 store in one frozen dataclass, :class:`S3Options`, and where each comes from.

Precedence, highest first: a value given explicitly (constructor keyword, or
the job spec's ``checkpoint.s3`` section, which the trainer passes as such),
then the environment, then the default below. The environment variables:

``ELASTIC_FT_S3_SSE``
    ``AES256`` (SSE-S3), ``aws:kms`` (SSE-KMS) or ``none``; read when ``sse`` is unset.
``ELASTIC_FT_S3_SSE_KMS_KEY_ID``
    KMS key id/ARN/alias; read when ``sse_kms_key_id`` is unset. A key alone implies ``aws:kms``.

Endpoint and region left unset are boto3's own (``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``~/.aws/config``). Credentials (and
the profile that selects them) are never a setting here, so never in a job
spec: they come from boto3's chain (``AWS_PROFILE``, environment, instance role).

The job spec's ``checkpoint.s3`` section is this dataclass
(:class:`elastic_ft.config.CheckpointConfig`), bounded by ``config.LIMITS``.

Validation (:meth:`S3Options.problems`) is a pure function returning (field,
sentence) pairs, so the store and the job spec report the same rules, each
naming its field its own way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

from elastic_ft.checkpoint.errors import StoreError

MiB = 1 << 20

#: Environment variables read when the setting is not given (see the module docstring).
ENV_SSE = "ELASTIC_FT_S3_SSE"
ENV_SSE_KMS_KEY_ID = "ELASTIC_FT_S3_SSE_KMS_KEY_ID"

SSE_CHOICES = ("AES256", "aws:kms")

#: S3's smallest multipart part (all but the last).
MIN_PART_SIZE = 5 * MiB


def default_concurrency() -> int:
    """Transfers in flight per store: 3 per usable CPU, at most boto3's 10.

    Past that, on a small machine, more connections add contention, not
    speed: each transfer costs CPU (SigV4 hashes upload payloads; downloads
    copy, fault in fresh pages and hash every chunk). On 2 cores with the S3
    server alongside (bench/checkpoint.py), 6 in flight loaded 1 GB in 1.9 s
    where 10 took 2.1 s, and uploaded it in 7.5 s where 10 took 7.9 s.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(10, 3 * cpus))


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Options:
    """The S3 store's settings; ``None`` means "not given" (see :meth:`resolve`)."""

    endpoint_url: str | None = None
    """Endpoint override (default: boto3's, which honours ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``)."""
    region: str | None = None
    """A region name (default: boto3's)."""
    sse: Literal["AES256", "aws:kms", "none"] | None = None
    """``'AES256'`` (SSE-S3), ``'aws:kms'`` (SSE-KMS) or ``'none'`` (default: ``ELASTIC_FT_S3_SSE``, else none)."""
    sse_kms_key_id: str | None = None
    """KMS key for SSE-KMS (default: ``ELASTIC_FT_S3_SSE_KMS_KEY_ID``)."""
    # 8 MiB threshold and parts (boto3 upload_file/download_file defaults): measured by
    # bench/checkpoint.py against SeaweedFS, 16 MiB ranged GETs loaded a
    # 300 MB checkpoint at 0.72x boto3's speed and 8 MiB ones at 0.93-0.96x.
    multipart_threshold: int = 8 * MiB
    """Puts of this many bytes or more use multipart upload."""
    part_size: int = 8 * MiB
    """Multipart part size (S3 requires at least 5 MiB but for the last part)."""
    download_part_size: int = 8 * MiB
    """Size of each ranged GET of a download (a checkpoint blob, or an ``s3://`` input: an object of one part
    or less is one GET; fetching an input holds one part per worker in memory)."""
    max_concurrency: int | None = None
    """Parts uploaded / ranged GETs in flight per store, and per input fetch (default: :func:`default_concurrency`)."""
    max_attempts: int = 6
    """Attempts per request, the first included."""
    backoff_initial: float = 0.2
    """First retry delay in seconds (doubling, plus up to this much jitter)."""
    backoff_max: float = 10.0
    """Longest retry delay in seconds."""
    connect_timeout: float = 10.0
    """Socket connect timeout of the built client, in seconds."""
    read_timeout: float = 60.0
    """Socket read timeout of the built client, in seconds."""

    @classmethod
    def resolve(cls, settings: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None) -> S3Options:
        """Options from explicit ``settings`` (None values count as unset), then ``environ``
        (default ``os.environ``), then defaults. Not checked: call :meth:`check`.

        Unknown setting names raise :class:`TypeError` (a programming error, as for a keyword).
        """
        environ = os.environ if environ is None else environ
        given = {k: v for k, v in (settings or {}).items() if v is not None}
        if given.get("sse") is None:
            given["sse"] = environ.get(ENV_SSE) or None
        if given.get("sse_kms_key_id") is None:
            given["sse_kms_key_id"] = environ.get(ENV_SSE_KMS_KEY_ID) or None
        if given.get("max_concurrency") is None:
            given["max_concurrency"] = default_concurrency()
        return cls(**given)

    def problems(self) -> list[tuple[str, str]]:
        """Every rule this combination breaks, as (field name, sentence); unset fields are skipped."""
        p: list[tuple[str, str]] = []
        if self.part_size < MIN_PART_SIZE:
            p.append(("part_size", f"The multipart part size ({self.part_size}) must be at least 5 MiB "
                                   f"({MIN_PART_SIZE}), S3's minimum."))
        if self.multipart_threshold < self.part_size:
            p.append(("multipart_threshold", f"The multipart threshold ({self.multipart_threshold}) must be "
                                             f"at least the part size ({self.part_size})."))
        if self.download_part_size < 1:
            p.append(("download_part_size", f"The download part size ({self.download_part_size}) must be positive."))
        if self.max_concurrency is not None and self.max_concurrency < 1:
            p.append(("max_concurrency", f"The concurrency ({self.max_concurrency}) must be at least 1."))
        if self.max_attempts < 1:
            p.append(("max_attempts", f"The attempt count ({self.max_attempts}) must be at least 1."))
        if not 0 < self.backoff_initial <= self.backoff_max:
            p.append(("backoff_initial", f"The backoff bounds ({self.backoff_initial}, {self.backoff_max}) "
                                         "must satisfy 0 < initial <= max."))
        for name in ("connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                p.append((name, f"The {name.replace('_', ' ')} ({getattr(self, name)}) must be positive."))
        p.extend(_sse_problems(self.sse, self.sse_kms_key_id))
        return p

    def check(self, where: str = "the S3 store") -> None:
        """Raise :class:`StoreError` saying ``where`` is misconfigured, listing every problem with its field."""
        problems = self.problems()
        if problems:
            raise StoreError(f"{where} is misconfigured: " + " ".join(f"{f}: {m}" for f, m in problems))

    @property
    def sse_args(self) -> dict[str, str]:
        """The ``ServerSideEncryption`` arguments of every put (empty for none)."""
        sse, key = self.sse, self.sse_kms_key_id
        if sse is not None and sse.lower() == "none":
            return {}
        if sse is None and key:
            sse = "aws:kms"
        if sse is None:
            return {}
        args = {"ServerSideEncryption": sse}
        if key:
            args["SSEKMSKeyId"] = key
        return args


def _sse_problems(sse: str | None, kms_key_id: str | None) -> list[tuple[str, str]]:
    """The rules of the SSE pair: a known mode, and a KMS key only with ``aws:kms`` (or alone)."""
    if sse is not None and sse.lower() == "none":
        if kms_key_id:
            return [("sse_kms_key_id", f"S3 server-side encryption is 'none' but a KMS key id ({kms_key_id!r}) is set; "
                                       f"unset it (or {ENV_SSE_KMS_KEY_ID}) or choose sse='aws:kms'")]
        return []
    if sse is not None and sse not in SSE_CHOICES:
        return [("sse", f"S3 server-side encryption {sse!r} is not supported; use 'AES256' (SSE-S3), "
                        f"'aws:kms' (SSE-KMS) or 'none' (setting sse or {ENV_SSE})")]
    if sse == "AES256" and kms_key_id:
        return [("sse_kms_key_id", f"S3 server-side encryption 'AES256' takes no KMS key id, but {kms_key_id!r} "
                                   "is set; use sse='aws:kms' to encrypt with that key")]
    return []


__all__ = ["ENV_SSE", "ENV_SSE_KMS_KEY_ID", "MiB", "S3Options", "default_concurrency"]
