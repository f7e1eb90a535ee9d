"""Which checkpoint to load, decided by pure functions over what reading each one gave.

Reading a checkpoint ends in one of four outcomes, and only one of them proves
anything bad about the checkpoint itself:

- ``ok``: the manifest parsed and every blob verified;
- ``corrupt``: proven broken: a blob's size or sha256 differs, the manifest is
  torn, oversized, too deep or malformed, or a blob is missing *and a listing
  that succeeded confirms it*;
- ``foreign``: a well-formed manifest of another run or format version: the URI
  points somewhere wrong (a hard stop);
- ``unavailable``: the store did not answer (retries ran out, access denied, a
  disk or network error, a 404 that no listing confirmed): nothing is known.

:func:`choose` walks the outcomes newest first: corrupt checkpoints are passed
over (and retired by the caller), the first ``ok`` one is loaded, and a foreign
or unavailable one stops the choice with nothing retired, since a checkpoint
that merely could not be read may be the newest good one. The I/O that
produces the outcomes is :func:`elastic_ft.checkpoint.reader.load_newest`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from elastic_ft.checkpoint.manifest import ManifestCorrupt, ManifestForeign
from elastic_ft.checkpoint.store import BlobMismatch, ObjectNotFound, StoreError

OK, CORRUPT, FOREIGN, UNAVAILABLE = "ok", "corrupt", "foreign", "unavailable"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What reading the checkpoint at ``step`` (manifest ``key``) gave, and why."""

    step: int
    key: str
    reason: str
    kind: str = CORRUPT


def classify(exc: BaseException, *, blob_absent: bool | None = None) -> str | None:
    """The outcome kind an error while reading a checkpoint stands for.

    ``blob_absent`` matters only for :class:`ObjectNotFound`: True when a
    listing that succeeded confirmed the key is absent (corrupt); None or False
    otherwise (unavailable: a 404 alone may be a store still catching up, or a
    key that a listing shows). None for an error that says nothing about the
    store or the data (a bug): the caller re-raises it.
    """
    if isinstance(exc, ManifestForeign):
        return FOREIGN
    if isinstance(exc, (ManifestCorrupt, BlobMismatch)):
        return CORRUPT
    if isinstance(exc, ObjectNotFound):
        return CORRUPT if blob_absent else UNAVAILABLE
    if isinstance(exc, (StoreError, OSError, MemoryError)):
        return UNAVAILABLE
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint to load (None: none usable), the corrupt ones to retire, or why to stop."""

    load: Outcome | None
    retire: tuple[Outcome, ...]
    stop: Outcome | None = None
    """The foreign or unavailable outcome that forbids any decision (then ``load`` is None and ``retire`` empty)."""

    @property
    def reason(self) -> str:
        """One line for the error or the log."""
        if self.stop is not None and self.stop.kind == FOREIGN:
            return f"checkpoint at step {self.stop.step} is not this run's: {self.stop.reason}"
        if self.stop is not None:
            return (f"checkpoint at step {self.stop.step} could not be read, so none was chosen and nothing was "
                    f"retired: {self.stop.reason}; retry once the store answers")
        if self.load is not None:
            return f"checkpoint at step {self.load.step} verified, after {len(self.retire)} corrupt newer one(s)"
        return f"no usable checkpoint ({len(self.retire)} corrupt)"


def need_more(outcomes: Sequence[Outcome]) -> bool:
    """Whether reading one more (older) checkpoint could change :func:`choose`'s answer."""
    return all(o.kind == CORRUPT for o in outcomes)


def choose(outcomes: Sequence[Outcome]) -> Choice:
    """Decide from ``outcomes`` (newest first; reading may stop once :func:`need_more` is False).

    Edge cases: no outcomes (no checkpoint) and only corrupt ones both give
    ``load=None``; a corrupt checkpoint newer than an unavailable one is not
    retired either, since the stop means the run does not roll back now.
    """
    retire: list[Outcome] = []
    for o in outcomes:
        if o.kind == OK:
            return Choice(o, tuple(retire))
        if o.kind == CORRUPT:
            retire.append(o)
        elif o.kind in (FOREIGN, UNAVAILABLE):
            return Choice(None, (), o)
        else:
            raise ValueError(f"unknown checkpoint outcome {o.kind!r} for step {o.step}")
    return Choice(None, tuple(retire))
