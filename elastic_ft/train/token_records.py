"""The spec's records streamed into a rank's share of the token store (part files).

Records are counted first (JSON Lines: one pass over the lines without
parsing them; anything else: ``datasets``, whose Arrow tables are memory-mapped),
then a rank reads only its contiguous share, a batch of :data:`RECORD_BATCH`
records at a time: no rank holds more than one batch as Python objects.
JSON Lines are read through the data check's reader
(:func:`elastic_ft.train.datafiles.json_records`): the same blank lines
skipped, the same records counted, the same ``data.files[I]:LINE`` named, the
same bound on a line.
A sample is BOS, the prompt, the response, EOS (or BOS, the text, EOS), cut at
``max_length`` (also when packing: samples are packed whole into rows later); only
the response (or the whole text) is trained, exactly as the trainer did before the
store. A conversation (``messages_field``) is the chat template's rendering, its
assistant turns trained (:mod:`elastic_ft.train.chat`), cut likewise.

Cost: one tokenizer pass over the rank's share; memory of one batch.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np

from elastic_ft.config import DataConfig
from elastic_ft.train import chat
from elastic_ft.train.datafiles import (
    DataError, UnreadableLine, conversation_problem, json_head, json_records, kind_of, line_records,
    missing_field_error, needed_fields,
)

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
        if fmt == "json" and all(_is_json_lines(i, p) for i, p in enumerate(cfg.files)):
            self.count = sum(1 for _ in json_records(cfg.files, parse=False))
        else:
            self._dataset = load_dataset(cfg, fmt)
            columns = set(self._dataset.column_names)
            for field in self.fields:
                if field not in columns:
                    raise missing_field_error(field, columns)
            self.count = len(self._dataset)

    def place(self, index: int) -> str:
        """Where record ``index`` (0-based, across all files) is, for an error: ``data.files[I]:LINE`` in JSON
        Lines files (found by reading the lines again: only on the way to an error), else ``data record N``
        (a parquet row, a hub dataset's row, across the files, from 1)."""
        if self._dataset is None:
            where, lineno, _ = next(itertools.islice(json_records(self.cfg.files, parse=False), index, None))
            return f"{where}:{lineno}"
        return f"data record {index + 1}"

    def batches(self, lo: int, hi: int, size: int = RECORD_BATCH) -> Iterator[tuple[int, dict[str, list]]]:
        """``(index of the first record, {field: values})`` for records ``lo .. hi - 1``."""
        if self._dataset is not None:
            for start in range(lo, hi, size):
                try:
                    yield start, {f: list(self._dataset[start:min(hi, start + size)][f]) for f in self.fields}
                except UnicodeDecodeError as exc:
                    raise DataError(f"data holds text that is not UTF-8 ({exc.reason}); fix the data") from exc
            return
        rows = (value for _, _, value in itertools.islice(json_records(self.cfg.files, skip=lo), lo, hi))
        start = lo
        while batch := list(itertools.islice(rows, size)):
            yield start, {f: [row.get(f) for row in batch] for f in self.fields}
            start += len(batch)


def _is_json_lines(index: int, path: str) -> bool:
    """Whether a JSON file is JSON Lines of objects (its first record is one object), not one document
    (``datasets`` reads that)."""
    if json_head(path).startswith(b"["):  # an array on one line may be past a line's bound: never read as lines
        return False
    with open(path, "rb") as f:
        try:
            for _, value in line_records(f, f"data.files[{index}]", path):
                return isinstance(value, dict)
        except UnreadableLine:  # a pretty-printed object's first line: the data check passed it as a document
            return False
    return False


SAVED_MARKERS = ("state.json", "dataset_dict.json")
"""Files that mark a directory written by ``datasets``' ``save_to_disk`` (a Dataset, a DatasetDict)."""


def load_dataset(cfg: DataConfig, fmt: str | None):
    """The spec's records as a ``datasets.Dataset`` (Arrow, memory-mapped).

    ``data.dataset`` is a hub name, or a local directory: one written by ``save_to_disk`` is read with
    ``load_from_disk`` (``load_dataset`` refuses it), anything else (data files, a loading script) with
    ``load_dataset``. ``data.files`` are read with ``datasets``' loader for ``fmt`` (parquet, text, json).
    """
    import datasets

    datasets.disable_progress_bars()
    if cfg.dataset:
        where = f"data.dataset {cfg.dataset!r} (split {cfg.split!r})"
        try:
            if os.path.isdir(cfg.dataset) and any(os.path.isfile(os.path.join(cfg.dataset, m)) for m in SAVED_MARKERS):
                loaded = datasets.load_from_disk(cfg.dataset)
                if isinstance(loaded, datasets.DatasetDict):
                    if cfg.split not in loaded:
                        raise DataError(f"{where}: the saved dataset has splits {sorted(loaded)}; set data.split "
                                        f"to one of them")
                    loaded = loaded[cfg.split]
                return loaded
            return datasets.load_dataset(cfg.dataset, split=cfg.split)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{where} could not be loaded: {_one_line(exc)}") from exc
    try:
        return datasets.load_dataset(fmt, data_files=list(cfg.files), split="train")
    except Exception as exc:
        raise DataError(f"data.files {cfg.files!r} could not be read as {fmt}: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    """A reader's error as one printable line: ``datasets`` and pyarrow messages carry newlines and raw bytes
    of the file they failed on (a corrupt parquet footer), which would break the one-line report."""
    text = "".join(c if c.isprintable() else " " for c in str(exc))
    return " ".join(text.split()) or type(exc).__name__


def dataset_files(cfg: DataConfig) -> list[str]:
    """The files of a local ``data.dataset`` directory, sorted (their contents name the store); [] for a
    hub name."""
    if not (cfg.dataset and os.path.isdir(cfg.dataset)):
        return []
    out = []
    for root, dirs, files in os.walk(cfg.dataset):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
    return out


# ---------------------------------------------------------------- tokenizing a share


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text without special tokens, as ``tokenizer(texts, add_special_tokens=False)`` gives.

    A fast tokenizer's Rust backend is called directly, with ``encode_batch_fast`` (no character offsets
    tracked, no conversion of each encoding into a dict of Python lists): about half of the build's time
    goes to that otherwise. Only where that call means the same as transformers' (no truncation or padding
    set on the backend; transformers turns them off for this call); anything else goes through transformers.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None \
            and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode(columns: dict[str, list], first: int, cfg: DataConfig, tokenizer,
           place=lambda index: f"data record {index + 1}") -> tuple[list[list[int]], list[int]]:
    """The token ids of each record and how many of its leading tokens are not trained.

    Records are numbered from ``first`` (0-based, across all files); ``place(index)`` names one in an
    error. A sample is BOS, the prompt, the response, EOS (or BOS, the text, EOS), cut at ``max_length``
    (packing places whole samples into rows later: :mod:`elastic_ft.train.token_packing`); a prompt is
    not trained.
    """
    def texts(field: str) -> list[str]:
        values = columns[field]
        for k, text in enumerate(values):
            if not isinstance(text, str):
                raise DataError(f"{place(first + k)}: field {field!r} is {kind_of(text)}, not text; "
                                f"fix or remove that record")
        return token_ids(tokenizer, values)

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


def encode_chat(columns: dict[str, list], first: int, cfg: DataConfig, tokenizer, template: str,
                place=lambda index: f"data record {index + 1}") -> tuple[list[list[int]], list[list[int]]]:
    """The token ids of each record's conversation (``cfg.messages_field``) rendered with ``template``, and a
    0/1 trained mark per token (the assistant turns: :mod:`elastic_ft.train.chat`), cut at ``max_length``
    (also when packing: rows take whole samples). Records are numbered from ``first``; ``place(index)``
    names one in an error."""
    field = cfg.messages_field
    cut = cfg.max_length
    conversations = columns[field]
    for k, messages in enumerate(conversations):  # a parquet or hub row: JSON Lines were checked already
        if (problem := conversation_problem(messages, field)) is not None:
            raise DataError(f"{place(first + k)}: {problem}; fix or remove that record")
    try:
        samples, marks = chat.encode_conversations(tokenizer, template, conversations)
    except chat.ConversationError as exc:
        raise DataError(f"{place(first + exc.index)}: field {field!r}: {exc}; fix or remove that record") from exc
    return [s[:cut] for s in samples], [m[:cut] for m in marks]


def encode_marked(columns: dict[str, list], first: int, cfg: DataConfig, tokenizer, template: str | None = None,
                  place=lambda index: f"data record {index + 1}") -> tuple[list[list[int]], np.ndarray]:
    """:func:`encode` or :func:`encode_chat` of a batch: each sample's token ids, and every token's trained mark
    (uint8, the samples' back to back)."""
    if cfg.messages_field:
        samples, masks = encode_chat(columns, first, cfg, tokenizer, template, place)
        total = sum(len(s) for s in samples)
        return samples, np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=total)
    samples, untrained = encode(columns, first, cfg, tokenizer, place)
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    marks = np.ones(int(lengths.sum()), dtype=np.uint8)
    for s, u in zip(np.cumsum(lengths) - lengths, untrained):
        marks[s:s + u] = 0
    return samples, marks


def tokenize_share(records: Records, lo: int, hi: int, cfg: DataConfig, tokenizer, dtype: np.dtype, out: str) -> None:
    """Records ``lo .. hi - 1`` as part files in ``out``: tokens, trained marks, sample lengths and targets."""
    template = chat.template_text(tokenizer, cfg.messages_field) if cfg.messages_field else None
    os.makedirs(out, exist_ok=True)
    files = {name: open(os.path.join(out, name), "wb") for name in PART_FILES}
    try:
        for first, columns in records.batches(lo, hi):
            samples, marks = encode_marked(columns, first, cfg, tokenizer, template, records.place)
            lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
            total = int(lengths.sum())
            files["tokens.bin"].write(np.fromiter(itertools.chain.from_iterable(samples), dtype=dtype, count=total).tobytes())
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
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


__all__ = ["PART_FILES", "RECORD_BATCH", "Records", "dataset_files", "encode", "encode_chat", "encode_marked",
           "load_dataset", "share", "token_ids", "tokenize_share"]
