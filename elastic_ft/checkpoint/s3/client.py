"""The boto3 S3 client a store builds for itself: the standard configuration, botocore's retries off."""

from __future__ import annotations

import threading
from typing import Any

from elastic_ft.checkpoint.s3.options import S3Options


def make_client(options: S3Options, profile: str | None = None) -> Any:
    """A boto3 S3 client from the standard configuration and ``options``, with botocore's retries off.

    An unset ``endpoint_url`` lets boto3 apply ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` and the profile's ``endpoint_url`` itself; an unset
    region is boto3's too. Credentials are boto3's chain, from the named
    ``profile`` if given (default: ``AWS_PROFILE``).
    """
    import boto3
    import botocore.session
    from botocore.config import Config

    assert options.max_concurrency is not None, "resolve the options first"
    config = Config(
        # One attempt: our tenacity policy does the retrying, and logs it.
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        # Each parallel part holds one pooled connection; leave room for the caller.
        max_pool_connections=max(10, 2 * options.max_concurrency),
    )
    # A fresh session per store, so environment and profile changes apply, but
    # one shared loader of botocore's service models: parsing the S3 model
    # again for every store doubles the cost of opening one.
    core = botocore.session.Session()
    core.register_component("data_loader", _shared_loader())
    session = boto3.session.Session(botocore_session=core, profile_name=profile)
    return session.client("s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config)


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    global _loader
    import botocore.loaders

    with _loader_lock:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        return _loader


__all__ = ["make_client"]
