"""Held-out data: the split of ``data.eval_fraction`` and the view of a token store's samples it gives.

:func:`held_out` decides per sample, with a keyed hash of ``(seed, index)``
compared with the fraction: which samples are held out depends on the data and
the seed only, never on the world size, the ranks or the order samples are read
in (TRL's ``train_test_split`` and axolotl's ``val_set_size`` shuffle with a
seed; a hash per index gives the same without building a permutation, and a
sample's side does not move when the dataset grows). :class:`SampleView` is the
training or the held-out side: the store's interface over an index array, so the
cursor and the step loop run over the training samples only.

Cost at every start: one pass of numpy over ``range(samples)`` (about 60 ms per
million samples on a loaded 2-core machine), and two int64 index arrays, 8 bytes per sample in all (8 MB
at a million samples); no Python object per sample.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from elastic_ft.train.datafiles import DataError
from elastic_ft.train.token_store import TokenStore

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _key(seed: int) -> np.uint64:
    """A 64-bit key of ``seed``: sha256, so nearby seeds give unrelated splits."""
    return np.uint64(int.from_bytes(hashlib.sha256(f"elastic_ft.eval_split/{seed}".encode()).digest()[:8], "little"))


def uniform(indices: np.ndarray, seed: int) -> np.ndarray:
    """A float64 in [0, 1) per sample index: splitmix64's finaliser of (index + key), its top 53 bits."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps: that is the hash
        z = indices.astype(np.uint64) * _GOLDEN + _key(seed)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def held_out(samples: int, fraction: float, seed: int) -> np.ndarray:
    """Which of ``samples`` samples are held out (a bool array): those whose hash falls below ``fraction``."""
    return uniform(np.arange(samples, dtype=np.int64), seed) < fraction


class SampleView:
    """Some of a :class:`TokenStore`'s items (samples, or packed rows with ``data.packing``: then whole rows
    are held out), renumbered ``0 .. len - 1`` in store order: the interface the step loop and the
    evaluation use (``len``, ``batch``, the token counts), each index mapped first."""

    def __init__(self, store: TokenStore, index: np.ndarray) -> None:
        self.store, self.index = store, np.ascontiguousarray(index, dtype=np.int64)
        self.header, self.max_length, self.pad_id = store.header, store.max_length, store.pad_id
        self.packed = store.packed

    def __len__(self) -> int:
        return len(self.index)

    def _map(self, indices: list[int]) -> list[int]:
        return self.index[np.asarray(indices, dtype=np.int64)].tolist() if len(indices) else []

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store.sample(int(self.index[index]))

    def target_count(self, indices: list[int]) -> int:
        return self.store.target_count(self._map(indices))

    def real_tokens(self, indices: list[int]) -> int:
        return self.store.real_tokens(self._map(indices))

    def micro_lengths(self, indices: list[int]) -> np.ndarray:
        return self.store.micro_lengths(self._map(indices))

    def computed_tokens(self, micro_batches: list[list[int]], *, flat: bool = False) -> int:
        return self.store.computed_tokens([self._map(c) for c in micro_batches], flat=flat)

    def batch(self, indices: list[int], *, flat: bool = False) -> dict[str, torch.Tensor]:
        return self.store.batch(self._map(indices), flat=flat)


def split(store: TokenStore, fraction: float, seed: int) -> tuple[SampleView, SampleView]:
    """(training samples, held-out samples) of ``store``; :class:`DataError` naming ``data.eval_fraction`` when
    either side would be empty."""
    mask = held_out(len(store), fraction, seed)
    held = np.flatnonzero(mask)
    train = np.flatnonzero(~mask)
    if len(held) == 0 or len(train) == 0:
        side = "no sample" if len(held) == 0 else "every sample"
        raise DataError(f"data.eval_fraction: {fraction} holds out {side} of the {len(store)} samples; "
                        f"choose a fraction that leaves samples on both sides")
    return SampleView(store, train), SampleView(store, held)


__all__ = ["SampleView", "held_out", "split", "uniform"]
