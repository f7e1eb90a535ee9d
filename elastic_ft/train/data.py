"""Training data: load texts (JSON Lines directly, anything else with ``datasets``), tokenize into
fixed-length samples.

Every rank loads and tokenizes the whole (small to medium) dataset itself, so
any rank can take any sample the cursor deals it: there are no shards to
reassign when the world changes. Each sample's count of target tokens is kept,
so the loss can be normalised by the exact global token count of a step.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from elastic_ft.config import DataConfig
from elastic_ft.inputs.resolve import InputSource, default_source
from elastic_ft.train.datafiles import (
    DataError, check_files, kind_of, missing_field_error, needed_fields, read_json_lines,
)

IGNORE = -100
_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


@dataclasses.dataclass
class TokenizedData:
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    target_tokens: torch.Tensor
    """Per sample: positions that contribute to the loss (after the causal shift)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx], "attention_mask": self.attention_mask[idx]}


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch's host tensors on ``device``, without a host sync on CUDA.

    On CUDA each tensor is first copied into page-locked (pinned) host memory, then
    to the device with ``non_blocking=True``: from pageable memory the copy is
    staged by the driver and blocks the host until it is done, once per tensor and
    micro-batch. The pinned block goes back to torch's caching host allocator
    only once the copy that reads it has completed (it records the stream), so
    nothing here waits. Pinning needs an accelerator and buys nothing without one:
    elsewhere the tensors are moved as they are (on the CPU, not copied at all).
    Cost: one host copy of the micro-batch (its ids, labels and mask) per micro-batch.
    """
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


class JsonLinesRecords:
    """Records of JSON Lines files read without ``datasets`` (:func:`read_json_lines`): what
    :func:`tokenize` reads of a ``datasets.Dataset``, its column names and a column by name."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self.column_names = list(dict.fromkeys(k for row in rows for k in row))

    def __getitem__(self, field: str) -> list:
        return [row.get(field) for row in self.rows]  # a record without the field: null, as in Arrow

    def __len__(self) -> int:
        return len(self.rows)


def load_records(cfg: DataConfig):
    """The records of the spec's files or hub dataset: a ``datasets.Dataset``, or for JSON Lines files
    :class:`JsonLinesRecords` (the same texts, in the same order)."""
    fmt = None if cfg.dataset else _local_format(cfg)
    rows = read_json_lines(list(cfg.files)) if fmt == "json" else None
    if rows is not None:
        return JsonLinesRecords(rows)
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


def _local_format(cfg: DataConfig) -> str:
    """The format of the spec's local files, once they exist and :func:`check_files` passed them."""
    missing = [f for f in cfg.files if not os.path.isfile(f)]
    if missing:
        raise DataError(f"data.files: {missing[0]!r} does not exist")
    fmt = cfg.format or _FORMATS.get(os.path.splitext(cfg.files[0])[1].lower())
    if fmt is None:
        raise DataError(f"data.format: cannot infer the format of {cfg.files[0]!r}; set data.format to json, parquet or text")
    check_files(cfg, fmt)
    return fmt


def texts_of(records, field: str) -> list[str]:
    """The column ``field`` as texts; a null or non-text value is a :class:`DataError` naming its record.

    Files were checked line by line already; this catches the same in parquet
    files and hub datasets (records numbered from 1, across all files).
    """
    try:
        texts = list(records[field])
    except UnicodeDecodeError as exc:
        raise DataError(f"data field {field!r} holds text that is not UTF-8 ({exc.reason}); fix the data") from exc
    for number, text in enumerate(texts, 1):
        if not isinstance(text, str):
            raise DataError(f"data record {number}: field {field!r} is {kind_of(text)}, not text; fix or remove that record")
    return texts


def tokenize(records, cfg: DataConfig, tokenizer) -> TokenizedData:
    """Fixed-length samples of ``cfg.max_length`` tokens from ``records``."""
    columns = set(records.column_names)
    for field in needed_fields(cfg):
        if field not in columns:
            raise missing_field_error(field, columns)
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    prefix = [bos] if bos is not None else []
    length = cfg.max_length
    rows: list[tuple[list[int], list[int]]] = []  # (ids, labels) before padding

    def encode(field):
        return tokenizer(texts_of(records, field), add_special_tokens=False)["input_ids"]

    if cfg.prompt_field:
        prompts, responses = encode(cfg.prompt_field), encode(cfg.response_field)
        for p, r in zip(prompts, responses):
            ids = (prefix + p + r + [eos])[:length]
            labels = ([IGNORE] * (len(prefix) + len(p)) + r + [eos])[:length]
            rows.append((ids, labels))
    elif cfg.packing:
        stream: list[int] = []
        for ids in encode(cfg.text_field):
            stream += prefix + ids + [eos]
        for start in range(0, len(stream) - length + 1, length):
            block = stream[start : start + length]
            rows.append((block, list(block)))
    else:
        for ids in encode(cfg.text_field):
            ids = (prefix + ids + [eos])[:length]
            rows.append((ids, list(ids)))
    if not rows:
        raise DataError(f"data yields no samples of max_length {length}; add data or lower data.max_length")
    n = len(rows)
    input_ids = torch.full((n, length), pad, dtype=torch.long)
    labels = torch.full((n, length), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, (ids, labs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(labs)] = torch.tensor(labs)
        mask[i, : len(ids)] = 1
    target_tokens = (labels[:, 1:] != IGNORE).sum(dim=1)
    return TokenizedData(input_ids, labels, mask, target_tokens)


def load(cfg: DataConfig, tokenizer, inputs: InputSource | None = None) -> TokenizedData:
    """The tokenized samples of ``cfg``; ``s3://`` files are read from this node's cached copies,
    fetched through ``inputs`` (default: the environment's cache and S3 settings)."""
    if inputs is None:
        with default_source() as own:
            return load(cfg, tokenizer, own)
    local = inputs.data(cfg)
    return tokenize(load_records(local), local, tokenizer)
