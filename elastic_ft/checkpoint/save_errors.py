"""What a checkpoint save can end in: the errors of :class:`~elastic_ft.checkpoint.saver.AsyncSaver`.

Each is a :class:`SaveFailed`; the trainer stops the run on those the saver
raises (a run must not train on with no checkpoint, beside another writer, or
with a state that is not finite). Kept apart from the saver so that whoever
reacts to an outcome (the trainer, the spot response) needs no saver.
"""

from __future__ import annotations

import torch


class SaveFailed(RuntimeError):
    """A checkpoint was not committed; the message says which step and why."""


class NonFiniteCheckpoint(SaveFailed):
    """A snapshot held NaN or infinite values, so it was refused (nothing of it is committed)."""


class SavesFailing(SaveFailed):
    """Saves failed ``max_failed_saves`` times in a row, or a snapshot was refused: stop the run."""


class SaveTimeout(SaveFailed):
    """A save did not finish within the saver's ``timeout_s``."""


class WriterFenced(SaveFailed):
    """Another writer holds the run (this writer's lease was lost, or its manifest conflicted): stop the run."""


class SaveAbandoned(SaveFailed):
    """The save was given up because the run ends on an error (:meth:`AsyncSaver.close` with ``abandon``)."""


def nonfinite_tensors(tensors: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """``group/name`` of each floating tensor holding a NaN or an infinity (sorted)."""
    return sorted(
        f"{group}/{name}" for group, named in tensors.items() for name, t in named.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    )
