"""The non-finite step guard: which steps skip their update, and when the run stops.

A NaN or infinite gradient would poison the weights and the optimizer state
for good (and every checkpoint after it). The training loop computes the
gradient norm after DDP's all-reduce, so every rank sees the same number, and
asks :meth:`NonFiniteGuard.observe` about it: a non-finite norm skips the
update on every rank alike, with no collective of its own. A non-finite loss
is caught the same way, since its gradient is non-finite too. Several such
steps in a row mean the run cannot recover by itself (``exhausted``).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class NonFiniteGuard:
    limit: int
    """Non-finite steps in a row after which the run stops (``optimizer.max_nonfinite_steps``)."""
    in_row: int = 0
    total: int = 0
    last_reason: str | None = None

    def observe(self, grad_norm: float, loss: float) -> str | None:
        """None for a finite step (the count in a row restarts); else why the step is skipped.

        ``grad_norm`` decides (it is the same on every rank); ``loss`` only
        completes the reason, so it may be this rank's share of the loss.
        """
        if math.isfinite(grad_norm):
            self.in_row = 0
            return None
        self.in_row += 1
        self.total += 1
        self.last_reason = f"gradient norm {grad_norm}" + ("" if math.isfinite(loss) else f", loss {loss}")
        return self.last_reason

    @property
    def exhausted(self) -> bool:
        return self.in_row >= self.limit

    def abort_message(self, step: int) -> str:
        return (
            f"training stopped at step {step}: {self.in_row} step(s) in a row had a non-finite loss or gradient "
            f"(optimizer.max_nonfinite_steps={self.limit}); the last: {self.last_reason}. Their updates were "
            f"skipped, so no checkpoint holds non-finite values; lower optimizer.lr or set optimizer.grad_clip, "
            f"check the data, then restart the job to resume from the newest checkpoint"
        )
