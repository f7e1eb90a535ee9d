"""The token store: every sample's tokens in one flat memory-mapped array, and micro-batches cut from it.

On disk a store is one directory of raw little-endian arrays and a JSON header
(never pickle):

- ``tokens.bin``: all samples' token ids back to back, in the smallest
  unsigned type that holds the vocabulary (``uint8``, ``uint16`` or ``uint32``);
- ``trained.bin``: one ``uint8`` per token, 1 where the token is a training
  target (its label is itself), 0 where it is not (a prompt: label ``IGNORE``);
- ``offsets.bin``: ``int64``, samples + 1 of them: sample ``i`` is tokens
  ``offsets[i] .. offsets[i+1]``;
- ``targets.bin``: ``int64`` per sample, its positions that count in the loss
  after the causal shift (its trained tokens but the first position), so a
  step's global token count needs no pass over its tokens;
- ``rows.bin`` and ``row_samples.bin`` (``int64``; empty unless ``data.packing``): packed row ``r`` holds
  the samples ``row_samples[rows[r]:rows[r+1]]`` (:mod:`elastic_ft.train.token_packing`);
- ``header.json``: the format, dtype, counts and the data settings' digest.

An *item* is what the cursor deals: a sample, or with packing a packed row
(every sample in exactly one). ``len(store)`` and the indices every method
takes count items.

Every rank maps the files read-only (``numpy.memmap``): opening costs a few
system calls whatever the dataset's size, and the pages of a micro-batch are
read when it is cut, shared by every rank of the node through the page cache.
A micro-batch is padded to its own longest sample rounded up to a multiple of
8 (:func:`padded_length`), never beyond ``max_length``: padding costs what the
batch's own lengths cost, not ``max_length`` per sample. A packed row's samples
each restart their position ids at 0, and the first label of each is ``IGNORE``
(after the causal shift no position is trained to predict the next sample's
first token); attention is kept inside a sample by those position ids (the
model's mask is built from them: see :func:`batch`).

Cost: open O(1); a micro-batch O(its tokens); a step's token counts O(its samples).
Building and committing a store is :mod:`elastic_ft.train.token_build`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import torch

FORMAT = "elastic_ft.tokens/2"
"""/2: rows.bin and row_samples.bin (packed rows of whole samples) joined the files; packing no longer cuts the
concatenated tokens into blocks. Part of the identity, so a store of another format is never taken for one."""
IGNORE = -100
PAD_MULTIPLE = 8
"""Micro-batch lengths are rounded up to this: tensor-core and vectorised kernels like multiples of 8, and
few distinct shapes keep allocator caches warm."""
FILES = ("tokens.bin", "trained.bin", "offsets.bin", "targets.bin", "rows.bin", "row_samples.bin", "header.json")
_OFFSET_DTYPE = np.dtype("<i8")
_MASK_DTYPE = np.dtype("u1")


class StoreFormatError(ValueError):
    """A store directory that is not a complete store of this format."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned little-endian type that holds ids ``0 .. vocab_size - 1``."""
    for name, top in (("u1", 1 << 8), ("<u2", 1 << 16), ("<u4", 1 << 32)):
        if vocab_size <= top:
            return np.dtype(name)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


def padded_length(longest: int, max_length: int) -> int:
    """The length a micro-batch whose longest sample has ``longest`` tokens is padded to."""
    return min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, max(max_length, longest))


@dataclasses.dataclass(frozen=True)
class Header:
    dtype: str
    samples: int
    tokens: int
    max_length: int
    pad_id: int
    vocab_size: int
    identity: str
    """The store's content identity (:func:`elastic_ft.train.token_build.identity`)."""
    rows: int = 0
    """Packed rows (0: not packed, the items are the samples)."""
    format: str = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True).encode() + b"\n"


def read_header(directory: str) -> Header:
    path = os.path.join(directory, "header.json")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 16))
        header = Header(**doc)
    except (OSError, ValueError, TypeError) as exc:
        raise StoreFormatError(f"token store {directory!r}: unreadable header ({exc})") from exc
    if header.format != FORMAT:
        raise StoreFormatError(f"token store {directory!r} has format {header.format!r}, not {FORMAT!r}")
    return header


class TokenStore:
    """A store directory mapped read-only: the items (samples, or packed rows) the trainer draws micro-batches from."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.header = h = read_header(directory)
        self.max_length, self.pad_id = h.max_length, h.pad_id

        def mapped(name: str, dtype: np.dtype, count: int) -> np.ndarray:
            path = os.path.join(directory, name)
            size = os.path.getsize(path)
            if size != count * dtype.itemsize:
                raise StoreFormatError(f"token store {directory!r}: {name} has {size} bytes, "
                                       f"its header implies {count * dtype.itemsize}")
            # An empty file cannot be mapped; a store always has samples, but stay total.
            return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype)

        self.tokens = mapped("tokens.bin", np.dtype(h.dtype), h.tokens)
        self.trained = mapped("trained.bin", _MASK_DTYPE, h.tokens)
        self.offsets = mapped("offsets.bin", _OFFSET_DTYPE, h.samples + 1)
        self.targets = mapped("targets.bin", _OFFSET_DTYPE, h.samples)
        self.packed = h.rows > 0
        self.rows = mapped("rows.bin", _OFFSET_DTYPE, h.rows + 1 if self.packed else 0)
        self.row_samples = mapped("row_samples.bin", _OFFSET_DTYPE, h.samples if self.packed else 0)

    def __len__(self) -> int:
        """Items: packed rows when packed, else samples."""
        return self.header.rows if self.packed else self.header.samples

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index``'s token ids and trained-token marks (views of the mapped files)."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.trained[start:end]

    def samples_of(self, items: list[int]) -> list[np.ndarray]:
        """Per item, the samples it holds in order (int64): itself, or a packed row's samples."""
        if not self.packed:
            return [np.asarray([i], dtype=np.int64) for i in items]
        return [np.asarray(self.row_samples[int(self.rows[r]):int(self.rows[r + 1])]) for r in items]

    def _flat_samples(self, items: list[int]) -> np.ndarray:
        """The samples of ``items``, repeats counted (O(the items' samples))."""
        if not self.packed:
            return np.asarray(items, dtype=np.int64)
        return np.concatenate(self.samples_of(items)) if items else np.zeros(0, np.int64)

    def target_count(self, indices: list[int]) -> int:
        """Loss positions (after the causal shift) of the items ``indices``, repeats counted."""
        return int(self.targets[self._flat_samples(indices)].sum()) if indices else 0

    def real_tokens(self, indices: list[int]) -> int:
        """Tokens of the items ``indices`` (no padding), repeats counted."""
        idx = self._flat_samples(indices)
        return int((self.offsets[idx + 1] - self.offsets[idx]).sum()) if indices else 0

    def micro_lengths(self, indices: list[int]) -> np.ndarray:
        """Tokens of each item (a packed row: its samples' sum)."""
        if not self.packed:
            idx = np.asarray(indices, dtype=np.int64)
            return self.offsets[idx + 1] - self.offsets[idx]
        return np.fromiter((int((self.offsets[s + 1] - self.offsets[s]).sum()) for s in self.samples_of(indices)),
                           dtype=np.int64, count=len(indices))

    def computed_tokens(self, micro_batches: list[list[int]], *, flat: bool = False) -> int:
        """Token positions the model computes for ``micro_batches`` (lists of item indices), as :meth:`batch`
        lays them out: each padded to :func:`padded_length` of its longest item, or with ``flat`` one row
        of exactly its tokens."""
        total = 0
        for chunk in micro_batches:
            if chunk:
                lengths = self.micro_lengths(chunk)
                total += int(lengths.sum()) if flat else len(chunk) * padded_length(int(lengths.max()), self.max_length)
        return total

    def batch(self, indices: list[int], *, flat: bool = False) -> dict[str, torch.Tensor]:
        """The items ``indices`` as int64 tensors, right-padded to :func:`padded_length` of the longest item:
        pad id and ``IGNORE`` past each item's end.

        Not packed: ``input_ids``, ``labels`` and ``attention_mask`` (0 on padding). Packed: ``input_ids``,
        ``labels`` and ``position_ids`` restarting at 0 at each sample (and at the padding, which thus is a
        sequence of its own), no ``attention_mask``: transformers then builds the causal mask block-diagonal
        from the position ids (``masking_utils.find_packed_sequence_indices``: eager, sdpa, flex), and
        flash-attention takes them as variable-length sequences, which it does only for a batch of one row:
        with ``flat`` the items are laid end to end in one row with no padding at all.
        """
        if flat and not self.packed:
            raise ValueError("batch: flat is for packed stores (unpacked samples have no position ids to keep apart)")
        n = len(indices)
        groups = self.samples_of(indices)
        lengths = self.micro_lengths(indices)
        if flat:
            rows, width = (1 if n else 0), int(lengths.sum())
        else:
            rows, width = n, (padded_length(int(lengths.max()), self.max_length) if n else 0)
        ids = np.full((rows, width), self.pad_id, dtype=np.int64)
        labels = np.full((rows, width), IGNORE, dtype=np.int64)
        extra = np.zeros((rows, width), dtype=np.int64)  # attention_mask, or position_ids
        at = 0
        for item, samples in enumerate(groups):
            row = 0 if flat else item
            if not flat:
                at = 0
            for index in samples.tolist():
                tokens, trained = self.sample(index)
                k = len(tokens)
                ids[row, at:at + k] = tokens
                labels[row, at:at + k] = np.where(trained.astype(bool), tokens.astype(np.int64), IGNORE)
                if self.packed:
                    # No position predicts a sample's first token from the previous sample (the causal shift
                    # reads labels[t + 1]); a sample's own first label is never a target anyway.
                    labels[row, at] = IGNORE
                    extra[row, at:at + k] = np.arange(k)
                else:
                    extra[row, at:at + k] = 1
                at += k
            if self.packed and not flat:
                extra[row, at:] = np.arange(width - at)
        if not self.packed:
            return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                    "attention_mask": torch.from_numpy(extra)}
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(extra)}


__all__ = ["FILES", "FORMAT", "Header", "IGNORE", "PAD_MULTIPLE", "StoreFormatError", "TokenStore",
           "padded_length", "read_header", "token_dtype"]
