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
- ``header.json``: the format, dtype, counts and the data settings' digest.

Every rank maps the files read-only (``numpy.memmap``): opening costs a few
system calls whatever the dataset's size, and the pages of a micro-batch are
read when it is cut, shared by every rank of the node through the page cache.
A micro-batch is padded to its own longest sample rounded up to a multiple of
8 (:func:`padded_length`), never beyond ``max_length``: padding costs what the
batch's own lengths cost, not ``max_length`` per sample.

Cost: open O(1); a micro-batch O(its tokens); a step's token counts O(its samples).
Building and committing a store is :mod:`elastic_ft.train.token_build`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import torch

FORMAT = "elastic_ft.tokens/1"
IGNORE = -100
PAD_MULTIPLE = 8
"""Micro-batch lengths are rounded up to this: tensor-core and vectorised kernels like multiples of 8, and
few distinct shapes keep allocator caches warm."""
FILES = ("tokens.bin", "trained.bin", "offsets.bin", "targets.bin", "header.json")
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
    """A store directory mapped read-only: the samples the trainer draws micro-batches from."""

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

    def __len__(self) -> int:
        return self.header.samples

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (a new array of ``samples`` int64: computed on use, not kept)."""
        return np.diff(self.offsets)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index``'s token ids and trained-token marks (views of the mapped files)."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.trained[start:end]

    def target_count(self, indices: list[int]) -> int:
        """Loss positions (after the causal shift) of the samples ``indices``, repeats counted."""
        return int(self.targets[np.asarray(indices, dtype=np.int64)].sum()) if indices else 0

    def real_tokens(self, indices: list[int]) -> int:
        """Tokens of the samples ``indices`` (no padding), repeats counted."""
        idx = np.asarray(indices, dtype=np.int64)
        return int((self.offsets[idx + 1] - self.offsets[idx]).sum()) if indices else 0

    def micro_lengths(self, indices: list[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        return self.offsets[idx + 1] - self.offsets[idx]

    def computed_tokens(self, micro_batches: list[list[int]]) -> int:
        """Token positions the model computes for ``micro_batches`` (lists of sample indices): each padded
        to :func:`padded_length` of its longest sample."""
        total = 0
        for chunk in micro_batches:
            if chunk:
                total += len(chunk) * padded_length(int(self.micro_lengths(chunk).max()), self.max_length)
        return total

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The samples ``indices`` as ``input_ids``, ``labels`` and ``attention_mask`` (int64), right-padded
        to :func:`padded_length` of the longest: pad id, ``IGNORE`` and 0 past each sample's end."""
        n = len(indices)
        lengths = self.micro_lengths(indices)
        width = padded_length(int(lengths.max()), self.max_length) if n else 0
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        labels = np.full((n, width), IGNORE, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        for row, index in enumerate(indices):
            tokens, trained = self.sample(index)
            k = len(tokens)
            ids[row, :k] = tokens
            labels[row, :k] = np.where(trained.astype(bool), tokens.astype(np.int64), IGNORE)
            mask[row, :k] = 1
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "attention_mask": torch.from_numpy(mask)}


__all__ = ["FILES", "FORMAT", "Header", "IGNORE", "PAD_MULTIPLE", "StoreFormatError", "TokenStore",
           "padded_length", "read_header", "token_dtype"]
