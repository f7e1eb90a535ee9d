"""The token store's identity: what names a store, so a changed input never reuses a stale one.

The identity is the sha256 of the store format, the data settings that change
tokens, each data file's contents (in order) and the tokenizer's serialized
form. A file's digest is remembered per (path, size, mtime, inode) in the
node cache (:class:`FileDigests`), so a start on a node that hashed the file
before reads no data file: cost O(1) then, one read of the data otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import Any

from elastic_ft.config import DataConfig
from elastic_ft.train.datafiles import DataError
from elastic_ft.train.token_workdirs import locked
from elastic_ft.train.token_store import FORMAT

log = logging.getLogger(__name__)

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


def data_format(cfg: DataConfig) -> str | None:
    """The format of the spec's local files (None for a hub dataset); :class:`DataError` if unknown."""
    if cfg.dataset:
        return None
    missing = [f for f in cfg.files if not os.path.isfile(f)]
    if missing:
        raise DataError(f"data.files: {missing[0]!r} does not exist")
    fmt = cfg.format or _FORMATS.get(os.path.splitext(cfg.files[0])[1].lower())
    if fmt is None:
        raise DataError(f"data.format: cannot infer the format of {cfg.files[0]!r}; set data.format to json, parquet or text")
    return fmt


def token_settings(cfg: DataConfig, fmt: str | None, chat_template: str | None = None) -> dict[str, Any]:
    """The data settings that change the tokens (not the files' paths: their contents are hashed). Chat data
    adds its field and the chat template's text, which the tokenizer's serialized form leaves out; other data
    names neither, so its stores keep their identity."""
    settings = {"format": fmt, "dataset": cfg.dataset, "split": cfg.split if cfg.dataset else None,
                "text_field": cfg.text_field, "prompt_field": cfg.prompt_field, "response_field": cfg.response_field,
                "max_length": cfg.max_length, "packing": cfg.packing}
    if cfg.messages_field:
        settings.update(messages_field=cfg.messages_field, chat_template=chat_template)
    return settings


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's serialized form and the special ids training uses."""
    h = hashlib.sha256()
    h.update(json.dumps({"class": type(tokenizer).__name__, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                         "pad": tokenizer.pad_token_id, "size": len(tokenizer)}, sort_keys=True).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
        return h.hexdigest()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # a slow tokenizer: its saved files
        tokenizer.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            h.update(name.encode() + b"\0")
            with open(os.path.join(tmp, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def identity(settings: dict[str, Any], file_digests: list[str], tokenizer_digest: str, extra: str = "") -> str:
    """The store's name: sha256 of the format, the settings, each data file's digest in order, the tokenizer."""
    doc = {"format": FORMAT, "settings": settings, "files": file_digests, "tokenizer": tokenizer_digest, "extra": extra}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class FileDigests:
    """sha256 of local files, remembered per (path, size, mtime, inode) in ``path``: a file hashed once on a
    node is not read again until it changes.

    Every local rank of a node names the store at once on a first start: a file not yet known is hashed
    under the node's lock on ``path`` (``<path>.lock``), after reading ``path`` again, so one rank hashes
    it and the others find its digest there; and each save merges into what is on disk, so no rank's
    digest is lost to another's write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.known = self._load()

    def _load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                known = json.load(f)
            return known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            return {}

    def _known(self, real: str, stamp: list[int]) -> str | None:
        entry = self.known.get(real)
        if isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        return None

    def digest(self, path: str) -> str:
        st = os.stat(path)
        real = os.path.realpath(path)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        if (known := self._known(real, stamp)) is not None:
            return known
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(locked(self.path + ".lock"))
            except OSError as exc:  # a node cache that cannot be written: hash unshared (slower, never wrong)
                log.warning("token store: could not lock %s: %s", self.path, exc)
            self.known.update(self._load())  # another local rank may have hashed it while we waited
            if (known := self._known(real, stamp)) is not None:
                return known
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            self.known[real] = {"stat": stamp, "sha256": h.hexdigest()}
            self._save()
            return h.hexdigest()

    def _save(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.known, f)
            os.replace(tmp, self.path)
        except OSError as exc:  # the next start hashes again: slower, never wrong
            log.warning("token store: could not record data file digests in %s: %s", self.path, exc)


__all__ = ["FileDigests", "data_format", "identity", "token_settings", "tokenizer_fingerprint"]
