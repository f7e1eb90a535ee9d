"""The spec's records streamed into a rank's share of the token store (part files).

Records are counted first (JSON Lines: one pass over the lines without
parsing them; anything else: ``datasets``, whose Arrow tables are memory-mapped),
then a rank reads only its contiguous share, a batch of :data:`RECORD_BATCH`
records at a time: no rank holds more than one batch as Python objects.
A sample is BOS, the prompt, the response, EOS (or BOS, the text, EOS), cut at
``max_length`` (also when packing: samples are packed whole into rows later); only the response (or the whole text) is trained,
exactly as the trainer did before the store.

Cost: one tokenizer pass over the rank's share; memory of one batch.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic_ft.config import DataConfig
from elastic_ft.train.datafiles import DataError, kind_of, missing_field_error, needed_fields

RECORD_BATCH = 1024
"""Records tokenized per tokenizer call: large enough for the fast tokenizer's threads, small enough that a
batch's Python lists stay a few MB."""
PART_FILES = ("tokens.bin", "trained.bin", "lengths.bin", "targets.bin")
"""A share's part files: tokens and trained marks as in the store; per sample its length and loss targets."""


class Records:
    """The spec's records, counted, then read in batches of columns by index range."""

    def __init__(self, cfg: DataConfig, fmt: str | None) -> None:
        self.cfg, self.fmt = cfg, fmt
        self.fields = list(needed_fields(cfg))
        self._dataset = None
        if fmt == "json" and all(_first_is_object(p) for p in cfg.files):
            self.count = sum(1 for _ in _json_lines(cfg.files, parse=False))
        else:
            self._dataset = load_dataset(cfg, fmt)
            columns = set(self._dataset.column_names)
            for field in self.fields:
                if field not in columns:
                    raise missing_field_error(field, columns)
            self.count = len(self._dataset)

    def batches(self, lo: int, hi: int, size: int = RECORD_BATCH) -> Iterator[tuple[int, dict[str, list]]]:
        """``(index of the first record, {field: values})`` for records ``lo .. hi - 1``."""
        if self._dataset is not None:
            for start in range(lo, hi, size):
                try:
                    yield start, {f: list(self._dataset[start:min(hi, start + size)][f]) for f in self.fields}
                except UnicodeDecodeError as exc:
                    raise DataError(f"data holds text that is not UTF-8 ({exc.reason}); fix the data") from exc
            return
        rows = itertools.islice(_json_lines(self.cfg.files, parse=True, skip=lo), hi - lo)
        start = lo
        while batch := list(itertools.islice(rows, size)):
            yield start, {f: [row.get(f) for row in batch] for f in self.fields}
            start += len(batch)


def _first_is_object(path: str) -> bool:
    """Whether a JSON file is JSON Lines of objects (its first non-blank line is one object), not one document."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            text = raw.lstrip(codecs.BOM_UTF8) if n == 0 else raw
            if text.strip():
                try:
                    return isinstance(json.loads(text), dict)
                except ValueError:
                    return False
    return False


def _json_lines(paths: list[str], *, parse: bool, skip: int = 0) -> Iterator[Any]:
    """The non-blank lines of JSON Lines files in order (parsed when ``parse``), the first ``skip`` unparsed."""
    seen = 0
    for path in paths:
        with open(path, "rb") as f:
            for n, raw in enumerate(f):
                if n == 0:
                    raw = raw.lstrip(codecs.BOM_UTF8)
                if not raw.strip():
                    continue
                seen += 1
                if seen <= skip:
                    continue
                yield json.loads(raw) if parse else None


def load_dataset(cfg: DataConfig, fmt: str | None):
    import datasets

    datasets.disable_progress_bars()
    if cfg.dataset:
        try:
            return datasets.load_dataset(cfg.dataset, split=cfg.split)
        except Exception as exc:
            raise DataError(f"data.dataset {cfg.dataset!r} (split {cfg.split!r}) could not be loaded: {exc}") from exc
    try:
        return datasets.load_dataset(fmt, data_files=list(cfg.files), split="train")
    except Exception as exc:
        raise DataError(f"data.files {cfg.files!r} could not be read as {fmt}: {exc}") from exc


# ---------------------------------------------------------------- tokenizing a share


def encode(columns: dict[str, list], first: int, cfg: DataConfig, tokenizer) -> tuple[list[list[int]], list[int]]:
    """The token ids of each record and how many of its leading tokens are not trained.

    Records are numbered from ``first`` (0-based, across all files) for errors. A sample is BOS, the
    prompt, the response, EOS (or BOS, the text, EOS), cut at ``max_length`` (packing places whole samples
    into rows later: :mod:`elastic_ft.train.token_packing`); a prompt is not trained.
    """
    def texts(field: str) -> list[str]:
        values = columns[field]
        for k, text in enumerate(values):
            if not isinstance(text, str):
                raise DataError(f"data record {first + k + 1}: field {field!r} is {kind_of(text)}, not text; "
                                f"fix or remove that record")
        return tokenizer(values, add_special_tokens=False)["input_ids"]

    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = [bos] if bos is not None else []
    cut = cfg.max_length
    if cfg.prompt_field:
        prompts, responses = texts(cfg.prompt_field), texts(cfg.response_field)
        samples = [prefix + p + r + [eos] for p, r in zip(prompts, responses)]
        untrained = [len(prefix) + len(p) for p in prompts]
    else:
        samples = [prefix + ids + [eos] for ids in texts(cfg.text_field)]
        untrained = [0] * len(samples)
    samples = [s[:cut] for s in samples]
    untrained = [min(u, cut) for u in untrained]
    return samples, untrained


def tokenize_share(records: Records, lo: int, hi: int, cfg: DataConfig, tokenizer, dtype: np.dtype, out: str) -> None:
    """Records ``lo .. hi - 1`` as part files in ``out``: tokens, trained marks, sample lengths and targets."""
    os.makedirs(out, exist_ok=True)
    files = {name: open(os.path.join(out, name), "wb") for name in PART_FILES}
    try:
        for first, columns in records.batches(lo, hi):
            samples, untrained = encode(columns, first, cfg, tokenizer)
            lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
            total = int(lengths.sum())
            files["tokens.bin"].write(np.fromiter(itertools.chain.from_iterable(samples), dtype=dtype, count=total).tobytes())
            marks = np.ones(total, dtype=np.uint8)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            for s, u in zip(starts, untrained):
                marks[s:s + u] = 0
            files["trained.bin"].write(marks.tobytes())
            files["lengths.bin"].write(lengths.astype("<i8").tobytes())
            # Loss positions after the shift: trained tokens but a sample's first position.
            first_marks = marks[starts] if len(starts) else np.zeros(0, np.uint8)
            trained = np.add.reduceat(marks, starts, dtype=np.int64) if total else np.zeros(len(samples), np.int64)
            targets = trained.astype(np.int64) - (first_marks.astype(np.int64) * (lengths > 0))
            files["targets.bin"].write(targets.astype("<i8").tobytes())
    finally:
        for f in files.values():
            f.close()


def share(count: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``count`` records among ``size`` ranks."""
    return count * rank // size, count * (rank + 1) // size


__all__ = ["PART_FILES", "RECORD_BATCH", "Records", "encode", "load_dataset", "share", "tokenize_share"]
