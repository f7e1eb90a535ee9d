"""When to commit a checkpoint (a pure function of the step and the clock)."""

from __future__ import annotations

from elastic_ft.config import CheckpointConfig


def checkpoint_due(*, step: int, total_steps: int, last_step: int, seconds_since: float | None,
                   cfg: CheckpointConfig, auto_steps: int | None = None) -> tuple[bool, str]:
    """(due, reason) after optimizer step ``step`` has completed.

    Nothing is saved twice for one step, and the final step is saved when
    ``save_final`` is set, so a finished run resumes as finished.
    ``seconds_since`` is the time since the last checkpoint as the ranks agreed
    on it (the leader's clock, at the boundary before the step: see
    :meth:`elastic_ft.train.preemption.Preemption.agree`), or None where they
    did not agree on one: then ``every_seconds`` waits for the next agreement
    (about half a second of steps later at most), so every rank decides alike.
    ``auto_steps``: with ``every_steps: auto``, the interval the ranks agreed on
    (:class:`~elastic_ft.train.checkpoint_interval.AutoInterval`; None before the first agreement).
    """
    if step <= last_step:
        return False, "already saved at this step"
    if step == total_steps and cfg.save_final:
        return True, "final step"
    every = auto_steps if cfg.every_steps == "auto" else cfg.every_steps
    if every is not None and step % every == 0:
        return True, f"every {every} steps{' (auto)' if cfg.every_steps == 'auto' else ''}"
    if cfg.every_seconds is not None and seconds_since is not None and seconds_since >= cfg.every_seconds:
        return True, f"{seconds_since:.0f}s since the last checkpoint (every {cfg.every_seconds:g}s)"
    return False, "not due"
