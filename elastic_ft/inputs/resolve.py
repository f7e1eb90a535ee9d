"""A spec's data files and model directories with their ``s3://`` URIs replaced by this node's cached copies.

Each worker resolves for itself, before loading: no collective is needed, as
the ranks of a node share the cache through its lock (:mod:`.cache`), and a
restarted worker or a retried job on the same host finds the copies there.
Local paths and hub names pass through unchanged. The spec itself keeps the
URIs (its hash and the copy saved with each checkpoint name the inputs, not
one node's cache); only the configs handed to the loaders are rewritten.

Every failure is one :class:`InputError` naming the spec field and the URI.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from elastic_ft.checkpoint.errors import StoreError
from elastic_ft.checkpoint.s3.options import S3Options
from elastic_ft.inputs.settings import InputsConfig, cache_root
from elastic_ft.inputs.uri import InputRefused, is_s3


class InputError(StoreError):
    """An input of the spec could not be fetched; the message names the field and what to do."""


class InputSource:
    """The inputs of one spec on this node: the cache under ``root`` (default from ``settings``),
    reached with ``s3`` settings; the S3 client is built on the first remote input (or ``client`` used)."""

    def __init__(self, settings: InputsConfig, s3: S3Options, *, root: str | None = None, client: Any = None) -> None:
        self.settings, self.s3, self.client = settings, s3, client
        self.root = root or cache_root(settings)
        self._cache: Any = None
        self._resolved: dict[str, str] = {}
        self.fetched: dict[str, list[str]] = {}
        """URI -> the files this source downloaded for it (empty when the cached copy was reused)."""

    @classmethod
    def from_spec(cls, spec: Any, **kwargs: Any) -> InputSource:
        """The source of a :class:`~elastic_ft.config.JobSpec`: its ``inputs`` and ``checkpoint.s3`` sections."""
        return cls(spec.inputs, spec.checkpoint.s3, **kwargs)

    def __enter__(self) -> InputSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> Any:
        if self._cache is None:
            from elastic_ft.inputs.cache import InputCache  # boto3 and friends only for a remote input
            from elastic_ft.inputs.remote import RemoteInputs

            self._cache = InputCache(self.root, RemoteInputs(self.s3, self.client), self.settings)
        return self._cache

    def _resolve(self, value: str, field: str, directory: bool) -> str:
        if value in self._resolved:
            return self._resolved[value]
        try:
            cache = self._open()
            got = cache.fetch_dir(value) if directory else cache.fetch_file(value)
        except (InputRefused, StoreError) as exc:
            raise InputError(f"{field}: {exc}") from exc
        except OSError as exc:
            raise InputError(f"{field}: {value} could not be cached in {self.root}: {exc}; "
                             "check that directory (inputs.cache_dir) is writable and has room") from exc
        self._resolved[value], self.fetched[value] = got.path, got.fetched
        return got.path

    def file(self, value: str, field: str) -> str:
        """The local path of the data file ``value`` (fetched if ``s3://``)."""
        return self._resolve(value, field, directory=False) if is_s3(value) else value

    def directory(self, value: str | None, field: str) -> str | None:
        """The local directory of the model or tokenizer ``value`` (fetched if ``s3://``)."""
        return self._resolve(value, field, directory=True) if value is not None and is_s3(value) else value

    def data(self, cfg: Any) -> Any:
        """A copy of the spec's data section whose files are local paths."""
        return dataclasses.replace(cfg, files=[self.file(f, f"data.files[{i}]") for i, f in enumerate(cfg.files)])

    def model(self, cfg: Any) -> Any:
        """A copy of the spec's model section whose model and tokenizer directories are local."""
        return dataclasses.replace(cfg, name_or_path=self.directory(cfg.name_or_path, "model.name_or_path"),
                                   tokenizer=self.directory(cfg.tokenizer, "model.tokenizer"))

    def close(self) -> None:
        if self._cache is not None:
            self._cache.remote.close()
            self._cache = None


def default_source() -> InputSource:
    """A source with the default settings: the environment's cache directory and S3 settings."""
    return InputSource(InputsConfig(), S3Options())


__all__ = ["InputError", "InputSource", "default_source"]
